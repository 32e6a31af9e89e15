"""Publication latency and apply pause per pattern (storage, direct, colocated), one run, SmolLM2-135M.

After each real DeepSpeed GRPO step (synthetic rows, as ``benchmarks.trainer_throughput``), the new
weights go to the rollout engine by one pattern, in rotation, so every pattern sees the same
machine state:

- storage: export → S3 upload (SeaweedFS, manifest last) → fetch + sha256 verify → hot-load;
- direct: export → the engine pulls the files over HTTP from the trainer and verifies them → hot-load;
  against the in-process engine, and (``--servers 1``) against a vLLM OpenAI server, whose worker
  pulls while it keeps serving;
- colocated: the in-process engine loads the trainer's tensors from memory.

Latency = trainer step done → the engine serves the new version. Apply pause = the part of it the
engine served nothing. For direct and colocated the S3 upload (durability, lineage) is off the
critical path; its time is printed apart. Each load is checked: the engine's logprobs of a fixed
continuation must match the trainer's own (mean |Δ| printed). Ratios are against storage,
measured in the same run.

Usage: ``python -m benchmarks.publish_latency [--rounds 3] [--servers 1]`` (needs ``make up``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np


def _check(engine, export_dir: str, prompt: list[int]) -> float:
    """Mean |Δ logprob| between the engine's sample and the exported weights' own forward pass."""
    from infra.rollout.engine import SampleRequest
    from infra.train.mismatch import trainer_logprobs

    out = engine.generate([SampleRequest(prompt, 8, 1.0, 1.0, 0)], ["bench-check"])[0]
    ref = trainer_logprobs(export_dir, [prompt + out.token_ids], "float32")[0][len(prompt) - 1:]
    return float(np.mean([abs(a - b) for a, b in zip(out.logprobs, ref, strict=True)]))


def main(argv: list[str] | None = None) -> int:
    """Run the rotation and print per-pattern medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3, help="publications per pattern")
    parser.add_argument("--servers", type=int, default=1, choices=(0, 1), help="also direct to a vLLM server")
    parser.add_argument("--out", default="benchmarks/results/publish_latency.json")
    args = parser.parse_args(argv)

    from transformers import AutoConfig, AutoTokenizer

    from benchmarks.trainer_throughput import synthetic_rows
    from infra.checkpoint import fetch, file_entries, publish
    from infra.model import resolve_model
    from infra.publish import DirectSource, pull
    from infra.rollout.engine import VLLMEngine
    from infra.storage import s3_filesystem
    from infra.train.trainer import GRPOTrainer

    model_dir = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = synthetic_rows(AutoConfig.from_pretrained(model_dir).vocab_size, 4, 128)
    fs = s3_filesystem("agentrl")
    root = f"s3://agentrl/bench/publish-{uuid.uuid4().hex[:8]}"
    scratch = Path(tempfile.mkdtemp(prefix="publish-bench-"))
    trainer = GRPOTrainer(model_dir, lr=1e-5, zero_stage=2, grad_clip=1.0, micro_batch_rows=4, tis_cap=2.0,
                          temperature=1.0, top_p=1.0, top_k=0, scale_by_std=False, mask_truncated=False,
                          max_seq_len=1024)
    engine = VLLMEngine(model_dir, max_model_len=1024, kv_cache_gib=1.0)
    server_engine, servers = None, []
    if args.servers:
        from infra.rollout.servers import ServerEngine, start_servers

        servers = start_servers(model_dir, 1, scratch / "logs", max_model_len=1024, kv_cache_gib=1.0, threads=1)
        server_engine = ServerEngine(servers, tokenizer)
    prompt = tokenizer("Publication check: the quick brown fox")["input_ids"]
    patterns = ["storage", "direct", "colocated"] + (["direct-server"] if args.servers else [])
    results: dict[str, list[dict]] = {p: [] for p in patterns}
    version = 0
    uploads: list[float] = []

    def export(v: int) -> tuple[Path, float]:
        t = time.monotonic()
        d = scratch / f"export-v{v}"
        trainer.export(d)
        tokenizer.save_pretrained(d)
        return d, time.monotonic() - t

    try:
        for rnd in range(args.rounds):
            for pattern in patterns:
                trainer.step(rows)  # a real optimizer step: new weights
                version += 1
                done = time.monotonic()  # trainer step done
                rec: dict = {"round": rnd, "version": version}
                if pattern == "storage":
                    d, rec["export_s"] = export(version)
                    t = time.monotonic()
                    publish(fs, d, f"{root}/v{version}", version, version - 1, version - 1, "float32")
                    local = scratch / f"fetched-v{version}"
                    fetch(fs, f"{root}/v{version}", local)
                    rec["transfer_s"] = time.monotonic() - t
                    rec["apply_pause_s"] = engine.load_weights(str(local), version)
                    check_dir, eng = str(d), engine
                elif pattern in ("direct", "direct-server"):
                    d, rec["export_s"] = export(version)
                    files = file_entries(d)
                    with DirectSource(d) as source:
                        t = time.monotonic()
                        if pattern == "direct":
                            local = pull(source.url, files, scratch / f"pulled-v{version}")
                            rec["transfer_s"] = time.monotonic() - t
                            rec["apply_pause_s"] = engine.load_weights(str(local), version)
                            eng = engine
                        else:
                            timing = server_engine.load_weights_direct(source.url, files, version)
                            rec["transfer_s"], rec["apply_pause_s"] = timing["transfer_s"], timing["pause_s"]
                            eng = server_engine
                    check_dir = str(d)
                else:  # colocated
                    t = time.monotonic()
                    state = trainer.fp32_state_dict()
                    rec["export_s"], rec["transfer_s"] = 0.0, time.monotonic() - t
                    rec["apply_pause_s"] = engine.load_tensors(state, version)
                    eng = engine
                rec["latency_s"] = time.monotonic() - done
                if pattern != "storage":  # the background upload, timed on its own here
                    if pattern == "colocated":
                        d, _ = export(version)
                    t = time.monotonic()
                    publish(fs, d, f"{root}/v{version}", version, version - 1, version - 1, "float32")
                    rec["background_upload_s"] = time.monotonic() - t
                    uploads.append(rec["background_upload_s"])
                    check_dir = str(d)
                rec["logprob_abs_diff"] = _check(eng, check_dir, prompt)
                results[pattern].append(rec)
                print(f"round {rnd} {pattern:13s} v{version}: latency {rec['latency_s']:.2f} s, apply pause "
                      f"{rec['apply_pause_s']:.2f} s, transfer {rec['transfer_s']:.2f} s, export "
                      f"{rec['export_s']:.2f} s, |Δlogprob| {rec['logprob_abs_diff']:.1e}", flush=True)
                for p in scratch.glob(f"*-v{version}"):
                    shutil.rmtree(p, ignore_errors=True)
    finally:
        for s in servers:
            s.stop()
        fs.rm(root, recursive=True)
        shutil.rmtree(scratch, ignore_errors=True)

    med = {p: {k: float(np.median([r[k] for r in rs])) for k in ("latency_s", "apply_pause_s", "transfer_s",
                                                                   "export_s", "logprob_abs_diff")}
           for p, rs in results.items()}
    base = med["storage"]["latency_s"]
    print(f"\n{args.model}, median of {args.rounds} publications per pattern (one run, patterns interleaved)")
    print("| pattern | latency (s) | apply pause (s) | transfer (s) | export (s) | latency / storage | |Δlogprob| |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for p, m in med.items():
        print(f"| {p} | {m['latency_s']:.2f} | {m['apply_pause_s']:.2f} | {m['transfer_s']:.2f} | "
              f"{m['export_s']:.2f} | {m['latency_s'] / base:.2f} | {m['logprob_abs_diff']:.1e} |")
    print(f"background S3 upload (direct, colocated; off the critical path): median {np.median(uploads):.2f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "rounds": args.rounds, "median": med,
                                          "records": results, "background_upload_s": uploads}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
