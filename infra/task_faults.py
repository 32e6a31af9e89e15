"""Why a task is unusable, as a cause class a person can act on.

``build_envs`` marks a task unusable with a free-text reason and a log; :func:`classify` turns the
two into one of a few cause classes, each with the fix that would make the task usable:

- ``unreachable_host``: a host this machine cannot resolve or reach (``astral.sh``, ``github.com``,
  ``huggingface.co``), or one that refused or errored (an external judge answering HTTP 4xx/5xx, a
  proxy's ``502 Bad Gateway`` at CONNECT, a TLS failure), was needed, at build or verification time.
  Counted apart: the task is fine and works where that host is reachable; nothing here patches
  upstream scripts around it.
- ``needs_network``: an offline build (``tasks.build_network = false``) failed at a step that
  downloads (``apt-get``, ``pip``, ``curl``...): the message names the Dockerfile line.
- ``registry_image``: a ``FROM``/``COPY --from`` image that is not local, has no local equivalent
  (``infra.base_images``) and could not be pulled (``registry image X cannot be pulled (reason)``:
  no registry reachable, none serves it); no base is substituted unless the run names one
  (``tasks.fallback_base_image``). The fix names the image and the three ways to supply it:
  ``docker load -i <file>``, ``tasks.base_images``, or a registry mirror (``tasks.registry_mirrors``).
- ``build_failed``: the Dockerfile failed for another reason (the log names the step).
- ``tests_environment_broken``: the reference solution ran but the tests themselves did not run
  (no test result at all: a missing test runner, a ``run-tests.sh`` that failed before pytest).
- ``dependency_drift``: the task has aged, here as upstream: its reference solution pins a package version
  the archive no longer serves (apt's ``E: Version 'X' for 'P' was not found``; pip's ``Could not find a
  version that satisfies the requirement P==X (from versions: ...)``, the index answered), or imports a name
  an unpinned dependency has since dropped (``ImportError: cannot import name 'X' from 'P'``, ``module 'P'
  has no attribute 'X'``). The fix names the pin or the package.
- ``solution_fails``: the tests ran and the reference solution failed them.
- ``do_nothing_passes``: the tests pass without any agent action.
- ``no_solution``: nothing to validate with.
- ``unsupported_feature``: the task folder uses a feature this project does not run yet.
- ``not_loaded``: the task folder is malformed (the message names file and field).
- ``infra``: validation could not run (sandbox failure); retried on the next build.
"""

from __future__ import annotations

import re

CAUSES = ("unreachable_host", "needs_network", "registry_image", "build_failed", "tests_environment_broken",
          "dependency_drift", "solution_fails", "do_nothing_passes", "no_solution", "unsupported_feature", "not_loaded",
          "infra")

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour and cursor codes (CSI, OSC and two-byte escapes)."""
    return _ANSI.sub("", text)


# Messages of curl, apt, pip, uv, requests, git and getaddrinfo that name a host they could not resolve or reach.
_HOST_PATTERNS = (
    r"Could not resolve host: ([A-Za-z0-9.-]+)",
    r"Temporary failure resolving '([A-Za-z0-9.-]+)'",
    r"Could not resolve '([A-Za-z0-9.-]+)'",
    r"Failed to resolve '([A-Za-z0-9.-]+)'",
    r"Failed to connect to ([A-Za-z0-9.-]+) port",
    r"HTTPSConnectionPool\(host='([A-Za-z0-9.-]+)'",
    r"HTTPConnectionPool\(host='([A-Za-z0-9.-]+)'",
    r"dns error: failed to lookup address information.*?for ([A-Za-z0-9.-]+)",
    r"Failed to fetch https?://([A-Za-z0-9.-]+)/",
    r"unable to access 'https?://([A-Za-z0-9.-]+)/",
    r"getaddrinfo .*?([A-Za-z0-9-]+\.[A-Za-z0-9.-]+)",
    r"unable to resolve host address [‘'\"]([A-Za-z0-9.-]+)",  # wget
    r"Resolving ([A-Za-z0-9.-]+) \([^)]*\)\.\.\. failed",  # wget
    r"couldn't connect to '?https?://([A-Za-z0-9.-]+)",  # huggingface_hub / transformers offline
    r"(?:Name or service not known|Temporary failure in name resolution)'? thrown while requesting \w+ "
    r"https?://([A-Za-z0-9.-]+)",  # huggingface_hub 1.x (httpx)
    r"solution could not reach host: ([A-Za-z0-9.-]+)",  # envs.task.TerminalTask.reference
    r"egress denied by policy: ([A-Za-z0-9.-]+)",  # infra.egress: the session's policy refused the host
    r"egress failed upstream: ([A-Za-z0-9.-]+)",  # infra.egress: the host refused or could not be reached
    # A host that answered with an HTTP error, refused a proxy tunnel or failed TLS, named by the message:
    r"\d{3} (?:Client|Server) Error: .*? for url: https?://([A-Za-z0-9.-]+)",  # requests' raise_for_status
    r"(?:Client|Server) error '\d{3}[^']*' for url 'https?://([A-Za-z0-9.-]+)",  # httpx's raise_for_status
    r"in connection to ([A-Za-z0-9.-]+):\d+",  # curl (35) OpenSSL SSL_connect: ... in connection to host:443
    r"\b(?:Get|Head|Post|Put|Patch|Delete) \"https?://([A-Za-z0-9.-]+)[^\"]*\": ",  # Go's url.Error (x509, TLS, 5xx)
)
_HOST = re.compile("|".join(f"(?:{p})" for p in _HOST_PATTERNS))
# Hosts that are reachable here: a message naming one is not an unreachable-host failure.
_REACHABLE_DEFAULT = ("deb.debian.org", "security.debian.org", "archive.ubuntu.com", "security.ubuntu.com",
                      "pypi.org", "files.pythonhosted.org")
# Offline symptoms: what apt, pip and curl print when there is no network at all.
_OFFLINE = re.compile(r"Unable to locate package|Temporary failure in name resolution|Network is unreachable|"
                      r"No matching distribution found|Could not resolve host|Temporary failure resolving|"
                      r"Failed to establish a new connection|Name or service not known")
_FETCHING_STEP = re.compile(r"\b(apt-get|apt|apk|pip3?|uv|curl|wget|git\s+clone|npm|conda|cargo|go\s+get)\b")
_STEP = re.compile(r"^Step (\d+)/(\d+) : (.*)$", re.MULTILINE)
_UNPULLED = re.compile(r"registry image (\S+) cannot be pulled")  # infra.sandbox.registry.RegistryPullError


# Messages that name a host without saying why it failed; counted when the log also shows a name lookup
# failing: pip names only the index it looks in (then "NewConnectionError ... Name or service not
# known" for a path), uv/reqwest names the URL (then "dns error").
_LOOKUP_FAILED = re.compile(r"Name or service not known|Temporary failure in name resolution|dns error|"
                            r"No address associated with hostname")
_NAMED_HOST = re.compile(r"Looking in (?:indexes|links): ((?:https?://[^\s,]+[, ]*)+)|"
                         r"error sending request for url \(https?://([A-Za-z0-9.-]+)[/:)]|"
                         r"^\s*GET https?://([A-Za-z0-9.-]+)", re.MULTILINE)  # GET: a fetch script's progress line


# Messages that say a host answered with an HTTP error, refused a proxy tunnel or failed TLS without naming
# it (urllib's ``HTTP Error 503``, curl's ``(22) The requested URL returned error: 502``, ``(60) SSL
# certificate problem``, ``(56) CONNECT tunnel failed, response 403``, wget's ``ERROR 503``, a proxy's
# ``502 Bad Gateway``); counted with the hosts of the URLs the log shows being fetched (a client call's
# line, a ``set -x`` trace, a traceback's source line, wget's ``Connecting to``).
_HTTP_FAILED = re.compile(r"curl: \((?:7|22|35|56|60)\)|urllib\.error\.(?:HTTPError|URLError)|HTTP Error \d{3}|"
                          r"\bERROR \d{3}: |\b502 Bad Gateway|\b503 Service Unavailable|\b403 Forbidden|"
                          r"Tunnel connection failed|CONNECT tunnel failed|CERTIFICATE_VERIFY_FAILED|"
                          r"certificate verify failed|SSL certificate problem|TLS handshake|tls handshake|"
                          r"Connection refused")
_FETCHED_URL = re.compile(r"^.*\b(?:curl|wget|urlopen|Request|requests\.\w+|httpx\.\w+|session\.\w+|fetch)\b"
                          r".*?https?://([A-Za-z0-9.-]+)|^Connecting to ([A-Za-z0-9.-]+) \(", re.MULTILINE)
# Loopback and this host: a refused connection there is the task's own service (the agent's doing), not egress.
_LOCAL = re.compile(r"^(?:localhost|127(?:\.\d+){3}|0\.0\.0\.0|[A-Za-z0-9-]+)$")

_LISTED = re.compile(r"unreachable host\(s\) ([A-Za-z0-9.-]+(?:, [A-Za-z0-9.-]+)*)")
_UNNAMED = "a host this machine cannot resolve (the log does not name it: a name lookup failed)"


def unreachable_hosts(log: str, reachable: tuple[str, ...] = _REACHABLE_DEFAULT) -> list[str]:
    """Hosts ``log`` says could not be resolved or reached, in order of first mention.

    Reached but failing counts too: a host that answered with an HTTP error (``503 Server Error: ... for
    url: https://host/...``), refused a proxy tunnel or failed TLS, named by the message or, when the
    message names none (urllib, curl, wget), by the URLs the log shows being fetched. Hosts reachable
    here (``reachable``: Debian's and Ubuntu's archives, PyPI) and loopback are left out.
    """
    text = strip_ansi(log)
    found: list[tuple[int, str]] = []
    for m in _HOST.finditer(text):
        found.append((m.start(), next(g for g in m.groups() if g)))
    if _LOOKUP_FAILED.search(text):
        for m in _NAMED_HOST.finditer(text):
            if m.group(1):
                found += [(m.start(), h) for h in re.findall(r"https?://([A-Za-z0-9.-]+)", m.group(1))]
            else:
                found.append((m.start(), m.group(2) or m.group(3)))
    if _HTTP_FAILED.search(text):
        for m in _FETCHED_URL.finditer(text):
            found.append((m.start(), m.group(1) or m.group(2)))
    for m in _LISTED.finditer(text):  # our own validation message lists them
        found += [(m.start(), h) for h in m.group(1).split(", ")]
    hosts: list[str] = []
    for _, host in sorted(found, key=lambda f: f[0]):
        host = host.rstrip(".")
        if host not in hosts and host not in reachable and "." in host and not _LOCAL.match(host):
            hosts.append(host)
    return hosts


# The task has aged: a pinned version the archive answered without (apt; pip, the index listed other
# versions), or a name an unpinned dependency no longer has.
_DRIFT = re.compile(r"E: Version '(?P<apt_v>[^']+)' for '(?P<apt_p>[^']+)' was not found|"
                    r"Could not find a version that satisfies the requirement (?P<pip>[A-Za-z0-9_.\[\]-]+==[^\s)]+) "
                    r"\(from versions: (?!none\))|"
                    r"ImportError: cannot import name '(?P<name>[\w.]+)' from '(?P<module>[\w.]+)'|"
                    r"AttributeError: module '(?P<attr_m>[\w.]+)' has no attribute '(?P<attr>\w+)'")
_LISTED_DRIFT = re.compile(r"^solution dependency drift: (.+)$", re.MULTILINE)


def drifted_dependencies(log: str) -> list[str]:
    """What ``log`` shows has moved on since the task was written, in order.

    E.g. ``gnupg=2.2.40-1.1 (no longer served)``, ``transformers no longer has AutoModelForVision2Seq``.
    """
    text = strip_ansi(log)
    found = []
    for m in _DRIFT.finditer(text):
        if m["apt_p"]:
            found.append(f"{m['apt_p']}={m['apt_v']} (no longer served)")
        elif m["pip"]:
            found.append(f"{m['pip']} (no longer served)")
        elif m["module"]:
            found.append(f"{m['module'].split('.')[0]} no longer has {m['name']}")
        else:
            found.append(f"{m['attr_m'].split('.')[0]} no longer has {m['attr']}")
    found += _LISTED_DRIFT.findall(text)
    return list(dict.fromkeys(found))


def failing_step(build_log: str) -> str:
    """The last ``Step N/M : ...`` line of a legacy-builder log (the step that failed), or ''."""
    steps = _STEP.findall(strip_ansi(build_log))
    return f"Step {steps[-1][0]}/{steps[-1][1]}: {steps[-1][2]}" if steps else ""


def classify(reason: str, log: str, validation: str = "", build_network: bool = True) -> tuple[str, str]:
    """The cause class of an unusable task and the fix that would make it usable.

    Args:
        reason: the catalog's reason (``image build failed: ...``, ``validation failed: ...``,
            ``task folder not loaded: ...``).
        log: the build and validation log (or the load error).
        validation: the catalog's validation state (``failed``, ``infra_failure``, ...).
        build_network: whether builds had network access.

    Returns:
        (cause, fix): ``cause`` one of :data:`CAUSES`; ``fix`` one sentence.
    """
    text = strip_ansi(f"{reason}\n{log}")
    hosts = unreachable_hosts(text)
    if reason.startswith("task folder not loaded"):
        if "not supported" in reason or "supported:" in reason:
            return "unsupported_feature", "the task uses a feature this project does not run yet (named above)"
        return "not_loaded", "fix the file and field the message names"
    if validation == "infra_failure" or reason.startswith("validation could not run"):
        return "infra", "a sandbox failed during validation; the next build_envs retries it"
    if reason.startswith(("image build failed", "set-up snapshot failed")):
        step = failing_step(log)
        at = f" at {step}" if step else ""
        if m := _UNPULLED.search(text):
            image = m.group(1)
            return "registry_image", (f"supply {image}: `docker load -i <file>` of a saved copy, "
                                      f'tasks.base_images = {{"{image}" = "<local image>"}}, or a registry '
                                      "mirror that serves it (tasks.registry_mirrors)")
        if "pull access denied" in text or "manifest unknown" in text or "no local equivalent" in text:
            return "registry_image", (f"supply the image{at}: `docker load -i <file>`, tasks.base_images, or a "
                                      "registry mirror that serves it (tasks.registry_mirrors)")
        if not build_network and (_OFFLINE.search(text) or _FETCHING_STEP.search(step)):
            return "needs_network", (f"the build downloads{at}, and builds are offline: set "
                                     "tasks.build_network = true (or bake what it fetches into a local base image)")
        if hosts:
            return "unreachable_host", f"needs {', '.join(hosts)}, which this machine cannot reach{at}"
        if build_network and _LOOKUP_FAILED.search(text):
            return "unreachable_host", f"needs {_UNNAMED}{at}"
        return "build_failed", f"the Dockerfile failed{at}; see the build log"
    denied = re.findall(r"egress denied by policy: ([A-Za-z0-9.-]+)", text)
    if denied and reason.startswith("validation failed"):
        return "unreachable_host", (f"the egress policy denies {', '.join(dict.fromkeys(denied))}: allow it with "
                                    "tasks.egress.allow (or the task's allowed_hosts)")
    if "no reference solution" in reason:
        return "no_solution", "add solution.sh (Terminal-Bench) or solution/solve.sh (Harbor)"
    if "do-nothing agent passes" in reason:
        return "do_nothing_passes", "the tests check nothing the agent must do; fix the tests"
    if hosts:
        return "unreachable_host", f"needs {', '.join(hosts)}, which this machine cannot reach"
    if (drift := drifted_dependencies(text)) and reason.startswith("validation failed"):
        return "dependency_drift", (f"the task has aged: {'; '.join(drift)}; pin the versions it was written for "
                                    "(or update the pin) in the task")
    if any(code in reason for code in ("tests_did_not_run", "no_tests_collected", "verifier_error", "no_reward_file",
                                       "verifier_timeout", "parse_error")):
        return "tests_environment_broken", ("the tests did not run (no test result): the test environment is "
                                            "broken, not the solution; see the verifier log")
    return "solution_fails", "the tests ran and the reference solution failed them; see the verifier log"
