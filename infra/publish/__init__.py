"""Weight publication: three patterns (``publish.kind``) for getting a trained version into the rollout engine.

- ``storage``: checkpoint files and a manifest go to S3 (manifest last); the engine fetches them,
  verifies every file's size and sha256 against the manifest, and hot-loads.
- ``direct``: the trainer serves its exported safetensors folder over HTTP (:class:`DirectSource`)
  and hands the engine the manifest's file list (sha256 and size per file); the engine pulls the
  bytes straight from the trainer, verifies them (:func:`pull`), and loads. No object store on the
  path; the S3 checkpoint is uploaded in the background.
- ``colocated``: trainer and an in-process engine share the machine; the engine loads the trainer's
  float32 tensors from memory (``reload_weights(weights_iterator=...)``). No checkpoint files on the
  path (with a bf16 forward or ZeRO-3 the trainer gathers its fp32 weights through a temporary
  DeepSpeed checkpoint); the S3 checkpoint is uploaded in the background.

Every pattern reports the **publication latency** (trainer step done → weights usable by the
engine) apart from the **apply pause** (the time the engine serves nothing). A checkpoint that
fails verification is refused: the engine keeps serving the version it has and the refusal is
returned (``"refused"`` in the load result of ``tasks.publish``, where each pattern's tasks live).
"""

from __future__ import annotations

import http.server
import shutil
import threading
from pathlib import Path

from infra.checkpoint import CheckpointError, sha256_file


class DirectSource:
    """Serve an exported checkpoint folder over HTTP so engines pull it straight from the trainer.

    ``GET {url}/{file}`` returns a file of the folder; nothing else is served (no listing, no
    paths outside it). Bind ``host`` to an address the engine machines reach (loopback here).
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, folder: Path, host: str = "127.0.0.1", port: int = 0):
        folder = Path(folder).resolve()
        names = {p.name for p in folder.iterdir() if p.is_file()}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                name = self.path.lstrip("/").split("?", 1)[0]  # a query (e.g. a signature) names no file
                if name not in names:
                    self.send_error(404, f"{name}: not in this checkpoint")
                    return
                path = folder / name
                self.send_response(200)
                self.send_header("Content-Length", str(path.stat().st_size))
                self.end_headers()
                with path.open("rb") as f:
                    shutil.copyfileobj(f, self.wfile, 1 << 20)

            def log_message(self, *args):  # quiet
                pass

        self._server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="direct-source", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> DirectSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pull(source: str | dict[str, str], files: dict[str, dict], dest: Path, timeout_s: float = 300.0) -> Path:
    """Download every file of a manifest's ``files`` into ``dest`` and verify it.

    ``source``: a base URL (``{source}/{name}``, a :class:`DirectSource`), or one URL per file name
    (e.g. S3 presigned GETs, :func:`infra.checkpoint.presigned_urls`). Errors name a URL without its
    query (a presigned URL's signature is a credential).

    Returns:
        ``dest``.

    Raises:
        CheckpointError: a file has no URL, could not be fetched, or its size or sha256 differs from the
            manifest (``dest`` is removed: nothing half-verified is left to load).
    """
    import httpx

    def url_of(name: str) -> str:
        if isinstance(source, str):
            return f"{source}/{name}"
        if name not in source:
            raise CheckpointError(f"{name}: the manifest lists it and no URL was given for it")
        return source[name]

    dest = Path(dest)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    try:
        with httpx.Client(timeout=timeout_s) as client:
            for name, meta in files.items():
                target, url = dest / name, url_of(name)
                shown = url.split("?", 1)[0]
                try:
                    with client.stream("GET", url) as resp:
                        resp.raise_for_status()
                        with target.open("wb") as f:
                            for chunk in resp.iter_bytes(1 << 20):
                                f.write(chunk)
                except httpx.HTTPError as e:
                    reason = f"HTTP {e.response.status_code}" if isinstance(e, httpx.HTTPStatusError) else str(e)
                    raise CheckpointError(f"{shown}: could not be fetched: {type(e).__name__}: {reason}") from e
                if target.stat().st_size != meta["size"] or sha256_file(target) != meta["sha256"]:
                    raise CheckpointError(f"{shown}: content does not match the manifest's size/sha256")
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return dest
