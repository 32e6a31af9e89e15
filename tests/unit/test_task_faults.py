"""Cause classes of unusable tasks, from messages real tools print (captured on this machine)."""

from infra.task_faults import classify, failing_step, strip_ansi, unreachable_hosts

CURL = "curl: (6) Could not resolve host: astral.sh"
GIT = "fatal: unable to access 'https://github.com/x/y/': Could not resolve host: github.com"
REQUESTS = ("HTTPSConnectionPool(host='huggingface.co', port=443): Max retries exceeded with url: /api/models "
            "(Caused by NameResolutionError(\"HTTPSConnection(host='huggingface.co', port=443): Failed to resolve "
            "'huggingface.co' ([Errno -2] Name or service not known)\"))")
APT_OFFLINE = ("Step 2/3 : RUN apt-get update && apt-get install -y curl\n ---> Running in 3f2a\n"
               "Reading package lists...\nE: Unable to locate package curl\n")
RUN_TESTS = f"Hit:1 http://deb.debian.org/debian bookworm InRelease\n{CURL}\nbash: uv: command not found\n"


WGET = ("Resolving training.lczero.org (training.lczero.org)... failed: Temporary failure in name resolution.\n"
        "wget: unable to resolve host address ‘training.lczero.org’")


# pip with an --index-url it cannot resolve names the index once, then only paths (pip 25, captured here)
PIP_INDEX = ("Looking in indexes: https://download.pytorch.org/whl/cpu\nWARNING: Retrying (Retry(total=4, "
             "connect=None, read=None, redirect=None, status=None)) after connection broken by 'NewConnectionError("
             "'<pip._vendor.urllib3.connection.HTTPSConnection object at 0x7f79996356a0>: Failed to establish a new "
             "connection: [Errno -2] Name or service not known')': /whl/cpu/torch/\nERROR: Could not find a version "
             "that satisfies the requirement torch==2.7.0 (from versions: none)\n")
# uv 0.8.14 fetching a managed Python (captured here)
UV_PYTHON = ("error: Failed to install cpython-3.13.7-linux-x86_64-gnu\n  Caused by: Request failed after 3 retries\n"
             "  Caused by: error sending request for url (https://github.com/astral-sh/python-build-standalone/releases"
             "/download/20250828/cpython-3.13.7.tar.gz)\n  Caused by: client error (Connect)\n  Caused by: dns error\n"
             "  Caused by: failed to lookup address information: Name or service not known\n")


# a Harbor media task's fetch script at build time (huggingface_hub 1.x, then urllib; captured here)
FETCH_MEDIA = ("    HF mm-tbench/mmtb-media:x/y.mp4 ...\n'[Errno -2] Name or service not known' thrown while "
               "requesting "
               "HEAD https://huggingface.co/datasets/mm-tbench/mmtb-media/resolve/main/x/y.mp4\n    HF download "
               "failed: An error happened while trying to locate the file on the Hub and we cannot find the requested "
               "files in the local cache.\n    GET https://download.blender.org/demo/movies/x.mp4 ...\n    download "
               "failed: <urlopen error [Errno -2] Name or service not known>\n")


def test_hosts_named_only_beside_a_failed_lookup_are_found():
    assert unreachable_hosts(FETCH_MEDIA) == ["huggingface.co", "download.blender.org"]
    assert unreachable_hosts(PIP_INDEX) == ["download.pytorch.org"]
    assert unreachable_hosts(UV_PYTHON) == ["github.com"]
    # the same lines without a failed name lookup (a 404, a TLS error) name no unreachable host
    assert unreachable_hosts(PIP_INDEX.replace("Name or service not known", "Connection refused")) == []
    assert unreachable_hosts("Looking in indexes: https://pypi.org/simple\nName or service not known") == []


def test_hosts_named_by_curl_git_requests_are_found_and_reachable_ones_are_not():
    assert unreachable_hosts(WGET) == ["training.lczero.org"]
    assert unreachable_hosts(f"{CURL}\n{GIT}\n{REQUESTS}\n{CURL}") == ["astral.sh", "github.com", "huggingface.co"]
    assert unreachable_hosts("Failed to fetch http://deb.debian.org/debian/dists/bookworm/InRelease") == []
    assert unreachable_hosts("E: Unable to locate package curl") == []


def test_offline_build_names_the_step_and_the_setting():
    cause, fix = classify("image build failed: The command '/bin/sh -c apt-get update' returned a non-zero code: 100",
                          APT_OFFLINE, build_network=False)
    assert cause == "needs_network"
    assert "Step 2/3: RUN apt-get update && apt-get install -y curl" in fix and "tasks.build_network = true" in fix


def test_online_build_failures_are_unreachable_host_or_plain_build_failures():
    uv_step = f"Step 3/5 : RUN curl -LsSf https://astral.sh/uv/install.sh | sh\n{CURL}"
    assert classify("image build failed: x", uv_step)[0] == "unreachable_host"
    cause, fix = classify("image build failed: x", "Step 4/4 : RUN make\nmake: *** No rule to make target")
    assert cause == "build_failed" and "Step 4/4: RUN make" in fix
    assert classify("image build failed: pull access denied for ghcr.io/x/y", "")[0] == "registry_image"


def test_real_unreachable_host_failures_are_counted_apart():
    """Seen on Terminal-Bench tasks: hf-model-inference's solution fails its tests because huggingface.co is
    unreachable (named in our validation message), and mnist-learning-fix's build downloads a dataset whose
    client names no host (httpx2 ``ConnectError: [Errno -2] Name or service not known``)."""
    hf = classify("validation failed: reference solution scored 0.0 (tests_failed); unreachable host(s) "
                  "huggingface.co, cdn-lfs.hf.co: FAILED ../tests/test_outputs.py::test_model_downloaded", "", "failed")
    assert hf == ("unreachable_host", "needs huggingface.co, cdn-lfs.hf.co, which this machine cannot reach")
    log = "Step 7/13 : RUN python create_dataset.py\n    raise mapped_exc(message) from exc\n" \
          "httpx2.ConnectError: [Errno -2] Name or service not known\n"
    cause, fix = classify("image build failed: The command '/bin/sh -c python create_dataset.py' returned 1", log)
    assert cause == "unreachable_host" and "does not name it" in fix and "Step 7/13" in fix
    # offline builds say so instead
    assert classify("image build failed: x", log, build_network=False)[0] == "needs_network"


def test_validation_tells_a_broken_test_environment_from_a_failing_solution():
    unreachable = classify("validation failed: reference solution scored 0.0 (tests_did_not_run); unreachable host(s) "
                           "astral.sh: ...", RUN_TESTS, "failed")
    assert unreachable == ("unreachable_host", "needs astral.sh, which this machine cannot reach")
    broken = classify("validation failed: reference solution scored 0.0 (tests_did_not_run): bash: pytest: not found",
                      "", "failed")
    assert broken[0] == "tests_environment_broken"
    assert classify("validation failed: reference solution scored 0.0 (tests_failed): 1 failed", "", "failed")[0] \
        == "solution_fails"
    assert classify("validation failed: a do-nothing agent passes (the tests check nothing)", "", "failed")[0] \
        == "do_nothing_passes"
    assert classify("validation could not run: sandbox_start_failed: x", "", "infra_failure")[0] == "infra"


def test_load_errors_unsupported_feature_apart_from_malformed():
    assert classify("task folder not loaded: x/steps: multi-step Harbor tasks are not supported", "")[0] \
        == "unsupported_feature"
    assert classify("task folder not loaded: x/task.yaml: field 'instruction' must be a non-empty string", "")[0] \
        == "not_loaded"


def test_colour_codes_are_stripped():
    assert strip_ansi("\x1b[1m\x1b[31mERROR\x1b[0m: x\x1b]0;title\x07 done\x1b[2K") == "ERROR: x done"
    assert failing_step("\x1b[1mStep 1/2 : FROM a\x1b[0m\nStep 2/2 : RUN b\n") == "Step 2/2: RUN b"


def test_a_host_the_reference_solution_could_not_reach_makes_it_unreachable_host(tmp_path):
    """The solution's whole output is searched (TerminalTask.reference keeps one line per host, then its tail)."""
    from envs.task import Outcome
    from envs.terminal_bench import load_terminal_task
    from tests.fakes import InMemorySandbox

    d = tmp_path / "t"
    (d / "tests").mkdir(parents=True)
    (d / "task.yaml").write_text("instruction: x\n")
    (d / "Dockerfile").write_text("FROM agentrl-base:bookworm\n")
    (d / "run-tests.sh").write_text("pytest $TEST_DIR/test_outputs.py -rA\n")
    (d / "tests" / "test_outputs.py").write_text("def test_x():\n    assert False\n")
    (d / "solution.sh").write_text("python3 fetch_model.py\n")
    hf = ("OSError: We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in "
          "the cached files.\n" + "x" * 2000 + "\nTraceback tail\n")
    pane = "=========================== short test summary info ===========================\nFAILED t::test_x\n"

    def exec_fn(box, command):
        if command.startswith("bash /tests/run-tests.sh"):
            box.files["/agentrl-run-tests.log"] = pane.encode()
        return (1, hf, 1.0, False) if "solution" in command else (0, "", 0.0, False)

    v = load_terminal_task(d).reference(InMemorySandbox("m", "img", {}, {}, exec_fn), True)
    assert v.outcome == Outcome.MODEL_FAILURE and "solution could not reach host: huggingface.co" in v.log
    assert classify(f"validation failed: reference solution scored 0.0 (tests_failed): {v.log[-500:]}", v.log,
                    "failed") == ("unreachable_host", "needs huggingface.co, which this machine cannot reach")


def test_an_unpullable_registry_image_names_the_image_and_its_three_remedies():
    """The message ``DockerBackend._supply_base_images`` raises when no registry serves a base image."""
    image = "swebench/sweb.eval.x86_64.example:latest"
    reason = (f"image build failed: FROM {image}: registry image {image} cannot be pulled ({image}: Get "
              '"https://registry-1.docker.io/v2/": dial tcp: lookup registry-1.docker.io: no such host), and it '
              "has no local equivalent (infra.base_images)")
    cause, fix = classify(reason, "")
    assert cause == "registry_image"  # not unreachable_host, though the message names a host
    assert f"supply {image}" in fix and "docker load -i <file>" in fix
    assert f'tasks.base_images = {{"{image}" = "<local image>"}}' in fix and "tasks.registry_mirrors" in fix


# Hosts that answered with an HTTP error, refused a proxy tunnel or failed TLS. Hand-written from the tools'
# message formats: requests' Response.raise_for_status, httpx's Response.raise_for_status (with its
# "For more information" line), urllib's HTTPError under pytest's source listing, curl 7.88 under `set -x`,
# wget 1.21, Go's net/http url.Error.
REQUESTS_503 = ("    def test_submission_is_graded():\n        r = requests.post(JUDGE, json=load())\n>       "
                "r.raise_for_status()\nE       requests.exceptions.HTTPError: 503 Server Error: Service Unavailable "
                "for url: https://judge.example.org/api/v1/grade\n")
HTTPX_502 = ("E   httpx.HTTPStatusError: Server error '502 Bad Gateway' for url 'https://grader.example.net/submit'\n"
             "E   For more information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/502\n")
URLLIB_403 = ("    def test_scores():\n        req = urllib.request.Request(\"https://score.example.com/v2/score\", "
              "data=body)\n>       with urllib.request.urlopen(req, timeout=30) as resp:\n\n"
              "/usr/lib/python3.11/urllib/request.py:643: in http_error_default\n"
              "    raise HTTPError(req.full_url, code, msg, hdrs, fp)\n"
              "E   urllib.error.HTTPError: HTTP Error 403: Forbidden\n")
CURL_22 = ("+ curl -fsS -X POST https://judge.example.org/api -d @/app/out.json\n"
           "curl: (22) The requested URL returned error: 502\n")
CURL_60 = ("+ curl -sSf https://internal.example.io/check\ncurl: (60) SSL certificate problem: unable to get local "
           "issuer certificate\nMore details here: https://curl.se/docs/sslcerts.html\n")
CURL_35 = "curl: (35) OpenSSL SSL_connect: SSL_ERROR_SYSCALL in connection to api.example.io:443 \n"
CURL_PROXY = ("+ curl -fsS https://models.example.ai/v1/models\ncurl: (56) CONNECT tunnel failed, response 403\n")
PIP_PROXY = ("WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after connection "
             "broken by 'ProxyError('Cannot connect to proxy.', OSError('Tunnel connection failed: 502 Bad "
             "Gateway'))': /simple/torch/\nERROR: Could not install packages due to an OSError: "
             "HTTPSConnectionPool(host='download.pytorch.org', port=443): Max retries exceeded with url: /whl/cpu\n")
WGET_503 = ("--2026-12-03 10:00:00--  https://data.example.org/file.csv\nResolving data.example.org (data.example.org)"
            "... 93.184.216.34\nConnecting to data.example.org (data.example.org)|93.184.216.34|:443... connected.\n"
            "HTTP request sent, awaiting response... 503 Service Unavailable\n2026-12-03 10:00:01 ERROR 503: Service "
            "Unavailable.\n")
GO_TLS = ('Error: Get "https://registry.example.dev/v2/": tls: failed to verify certificate: x509: certificate '
          "signed by unknown authority\n")
REQUESTS_TLS = ("requests.exceptions.SSLError: HTTPSConnectionPool(host='hub.example.com', port=443): Max retries "
                "exceeded with url: /x (Caused by SSLError(SSLCertVerificationError(1, '[SSL: "
                "CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer certificate "
                "(_ssl.c:1006)')))\n")


def test_hosts_that_answered_with_an_http_error_or_failed_tls_are_named():
    assert unreachable_hosts(REQUESTS_503) == ["judge.example.org"]
    assert unreachable_hosts(HTTPX_502) == ["grader.example.net"]  # not the "more information" link
    assert unreachable_hosts(URLLIB_403) == ["score.example.com"]
    assert unreachable_hosts(CURL_22) == ["judge.example.org"]
    assert unreachable_hosts(CURL_60) == ["internal.example.io"]  # not curl's own documentation link
    assert unreachable_hosts(CURL_35) == ["api.example.io"]
    assert unreachable_hosts(CURL_PROXY) == ["models.example.ai"]
    assert unreachable_hosts(PIP_PROXY) == ["download.pytorch.org"]
    assert unreachable_hosts(WGET_503) == ["data.example.org"]
    assert unreachable_hosts(GO_TLS) == ["registry.example.dev"]
    assert unreachable_hosts(REQUESTS_TLS) == ["hub.example.com"]


def test_http_errors_from_reachable_or_local_hosts_name_no_host():
    # PyPI answering 404, a task's own service on loopback refusing: not egress failures
    assert unreachable_hosts("requests.exceptions.HTTPError: 404 Client Error: Not Found for url: "
                             "https://pypi.org/simple/nosuchpkg/") == []
    assert unreachable_hosts("+ curl -fsS http://127.0.0.1:8000/health\ncurl: (7) Failed to connect to 127.0.0.1 "
                             "port 8000 after 0 ms: Connection refused\n") == []
    assert unreachable_hosts("+ curl -fsS http://localhost:5000/api\ncurl: (22) The requested URL returned "
                             "error: 500\n") == []
    # a URL fetched without any failure is not named
    assert unreachable_hosts("+ curl -fsS https://judge.example.org/api\n{\"ok\": true}\n") == []


def test_a_reference_run_failing_on_an_external_judge_is_unreachable_host_not_solution_fails():
    reason = "validation failed: reference solution scored 0.0 (tests_failed): FAILED test_outputs.py::test_graded"
    cause, fix = classify(reason, REQUESTS_503, "failed")
    assert cause == "unreachable_host" and fix == "needs judge.example.org, which this machine cannot reach"
    # reference-less validation: the do-nothing run's message lists the host
    cause, _ = classify("validation failed: reference-less: do-nothing scored 0.0 (tests_failed) with unreachable "
                        "host(s) judge.example.org, so the tests' result says nothing: ...", "", "failed")
    assert cause == "unreachable_host"
    cause, _ = classify("validation failed: reference-less: the tests gave no result for a do-nothing agent "
                        "(tests_did_not_run): ERROR: file or directory not found", "", "failed")
    assert cause == "tests_environment_broken"
    cause, _ = classify("validation failed: reference-less: a do-nothing agent passes (the tests check nothing)", "",
                        "failed")
    assert cause == "do_nothing_passes"


def test_a_task_that_has_aged_is_dependency_drift_not_solution_fails():
    """Two real Terminal-Bench tasks, as they fail today upstream as here: matlab-python-conversion pins
    gnupg=2.2.40-1.1 (bookworm now serves +deb12u2, so apt installs nothing and octave is missing);
    mteb-retrieve installs mteb==1.36.8, whose unpinned transformers (5.x) dropped a name it imports."""
    from infra.task_faults import drifted_dependencies

    apt = ("Package gnupg is not available, but is referred to by another package.\n"
           "E: Version '2.2.40-1.1' for 'gnupg' was not found\n/s.sh: line 58: octave: command not found\n")
    pip = ("ERROR: Could not find a version that satisfies the requirement numpy==1.19.9 (from versions: 1.26.4, "
           "2.0.0)\nERROR: No matching distribution found for numpy==1.19.9\n")
    offline = "ERROR: Could not find a version that satisfies the requirement numpy==1.26.4 (from versions: none)\n"
    imports = ('  File "/usr/local/lib/python3.10/site-packages/mteb/models/gme_v_models.py", line 13, in <module>\n'
               "    from transformers import AutoModelForVision2Seq, AutoProcessor\n"
               "ImportError: cannot import name 'AutoModelForVision2Seq' from 'transformers' "
               "(/usr/local/lib/python3.10/site-packages/transformers/__init__.py)\n")
    assert drifted_dependencies(apt) == ["gnupg=2.2.40-1.1 (no longer served)"]
    assert drifted_dependencies(pip) == ["numpy==1.19.9 (no longer served)"]
    assert drifted_dependencies(offline) == []  # the index did not answer: nothing says the pin has gone
    assert drifted_dependencies(imports) == ["transformers no longer has AutoModelForVision2Seq"]
    assert drifted_dependencies("AttributeError: module 'numpy' has no attribute 'float'") == \
        ["numpy no longer has float"]
    failed = "validation failed: reference solution scored 0.0 (tests_failed): 4 failed"
    log = "solution dependency drift: gnupg=2.2.40-1.1 (no longer served)\nsolution exit 1: ...\nverifier: 4 failed"
    cause, fix = classify(failed, log, "failed")
    assert cause == "dependency_drift" and "gnupg=2.2.40-1.1" in fix
    # a host the solution could not reach stays the cause: the task may work where that host answers
    assert classify(failed, f"solution could not reach host: github.com\n{log}", "failed")[0] == "unreachable_host"
