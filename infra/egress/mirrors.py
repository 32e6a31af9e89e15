"""What a declared mirror answers (``tasks.egress.mirrors``); stdlib only, run by the proxy's addon.

- ``uv``: uv's installer, ``https://astral.sh/uv/<version>/install.sh``, is answered with a short POSIX
  script that installs uv ``<version>`` as upstream's installer does (``$UV_UNMANAGED_INSTALL``,
  ``$UV_INSTALL_DIR``, ``$XDG_BIN_HOME``, ``$XDG_DATA_HOME/../bin``, else ``~/.local/bin``; an ``env``
  file there that puts it on ``PATH``; the shell profiles source it unless ``$UV_NO_MODIFY_PATH``),
  from the release archive below. The release archive,
  ``https://github.com/astral-sh/uv/releases/download/<version>/uv-<arch>-unknown-linux-<libc>.tar.gz``,
  is made from PyPI's ``uv`` wheel of that version (the same binaries: the wheel's
  ``uv-<version>.data/scripts/uv`` and ``uvx``), in upstream's layout (``uv-<arch>-unknown-linux-<libc>/uv``).
  The script says on stderr that a mirror served it, so the build or verification log shows it.
- ``folder``: the file under the mirror's folder at the URL's path below its prefix.
- ``url``: the same path under another base URL (the proxy fetches it).
- ``exclude-newer``: a package index's project page (the simple repository API, ``<prefix><project>/``)
  without the files uploaded at or after the cutoff, as uv's ``--exclude-newer`` and pip's
  ``--uploaded-prior-to`` resolve, for any client: a task written in June 2025 whose unpinned
  dependencies have since dropped names it uses installs what it was written against. The page is fetched
  in its JSON form (PEP 691), whose files carry ``upload-time`` (PEP 700); a file without one is left out.
  A client that asks only for HTML gets the same files as PEP 503 HTML.
"""

from __future__ import annotations

import html
import io
import json
import re
import ssl
import tarfile
import urllib.error
import urllib.request
import zipfile
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

_FETCH_TIMEOUT_S = 120


def fetch(url: str, cafile: str | None, accept: str = "*/*") -> bytes:
    """GET ``url`` from this machine (not through the proxy), trusting ``cafile``, with ``Accept: accept``.

    Raises:
        urllib.error.URLError: unreachable, or an HTTP error status.
    """
    context = ssl.create_default_context(cafile=cafile) if cafile else ssl.create_default_context()
    with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "agentrl-egress", "Accept": accept}),
                                timeout=_FETCH_TIMEOUT_S, context=context) as r:
        return r.read()


def _uv_files(index: str, cafile: str | None) -> dict:
    """The index's page for ``uv`` in the simple repository API's JSON form (PEP 691; ``versions``: PEP 700)."""
    return json.loads(fetch(f"{index.rstrip('/')}/simple/uv/", cafile,
                            accept="application/vnd.pypi.simple.v1+json"))


def uv_version(version: str, index: str, cafile: str | None) -> str:
    """``version``, or the index's newest uv release when it is empty (the installer without a version)."""
    if version:
        return version
    releases = [v for v in _uv_files(index, cafile).get("versions", []) if re.fullmatch(r"[0-9]+(\.[0-9]+)*", v)]
    if not releases:
        raise LookupError(f"{index} lists no uv release")
    return max(releases, key=lambda v: tuple(int(x) for x in v.split(".")))


def uv_installer_script(version: str, url: str) -> bytes:
    """The installer answered for ``url``: installs uv ``version`` from the (mirrored) release archive."""
    return f"""#!/bin/sh
# uv {version} installer served by the agentrl egress proxy's uv mirror (tasks.egress.mirrors) for
# {url}: it installs the binaries of PyPI's uv {version} wheel where upstream's installer puts them.
set -eu
echo "agentrl egress: {url} served by the uv mirror: uv {version} from PyPI's uv wheel" >&2
arch=$(uname -m)
case "$arch" in x86_64|amd64) arch=x86_64;; aarch64|arm64) arch=aarch64;; esac
libc=gnu
if ldd --version 2>&1 | grep -qi musl; then libc=musl; fi
archive="https://github.com/astral-sh/uv/releases/download/{version}/uv-$arch-unknown-linux-$libc.tar.gz"
modify_path=1
if [ -n "${{UV_UNMANAGED_INSTALL:-}}" ]; then dir=$UV_UNMANAGED_INSTALL; modify_path=0
elif [ -n "${{UV_INSTALL_DIR:-}}" ]; then dir=$UV_INSTALL_DIR
elif [ -n "${{XDG_BIN_HOME:-}}" ]; then dir=$XDG_BIN_HOME
elif [ -n "${{XDG_DATA_HOME:-}}" ]; then dir=$XDG_DATA_HOME/../bin
else dir=$HOME/.local/bin; fi
[ -z "${{UV_NO_MODIFY_PATH:-}}${{INSTALLER_NO_MODIFY_PATH:-}}" ] || modify_path=0
tmp=$(mktemp -d)
if command -v curl >/dev/null 2>&1; then curl -fsSL "$archive" -o "$tmp/uv.tar.gz"
elif command -v wget >/dev/null 2>&1; then wget -q "$archive" -O "$tmp/uv.tar.gz"
else python3 -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' \\
  "$archive" "$tmp/uv.tar.gz"; fi
tar -xzf "$tmp/uv.tar.gz" -C "$tmp"
mkdir -p "$dir"
for b in uv uvx; do cp "$tmp/uv-$arch-unknown-linux-$libc/$b" "$dir/$b"; chmod +x "$dir/$b"; done
rm -rf "$tmp"
echo "installing to $dir" >&2
cat > "$dir/env" <<EOF
#!/bin/sh
# add binaries to PATH if they aren't added yet
case ":\\${{PATH}}:" in
    *:"$dir":*) ;;
    *) export PATH="$dir:\\$PATH" ;;
esac
EOF
if [ "$modify_path" = 1 ]; then
  for rc in "$HOME/.profile" "$HOME/.bashrc" "$HOME/.bash_profile" "$HOME/.zshrc" "$HOME/.zshenv"; do
    if [ -f "$rc" ] || [ "$rc" = "$HOME/.profile" ]; then
      grep -qs "$dir/env" "$rc" || echo ". \\"$dir/env\\"" >> "$rc"
    fi
  done
fi
echo "everything's installed!" >&2
""".encode()


def uv_release_archive(version: str, arch: str, libc: str, index: str, cafile: str | None) -> bytes:
    """Uv's release archive ``uv-{arch}-unknown-linux-{libc}.tar.gz``, made from PyPI's wheel of ``version``.

    Raises:
        LookupError: the index has no such version, or no wheel for that platform.
        urllib.error.URLError: the index is unreachable.
    """
    platform = "manylinux" if libc == "gnu" else "musllinux"
    wheels = [f for f in _uv_files(index, cafile)["files"] if f["filename"].startswith(f"uv-{version}-")
              and f["filename"].endswith(f"_{arch}.whl") and platform in f["filename"]]
    if not wheels:
        raise LookupError(f"{index} has no uv {version} {platform} {arch} wheel")
    wheel = zipfile.ZipFile(io.BytesIO(fetch(wheels[0]["url"], cafile)))
    top = f"uv-{arch}-unknown-linux-{libc}"
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name in ("uv", "uvx"):
            data = wheel.read(f"uv-{version}.data/scripts/{name}")
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def folder_file(folder: str, path: str) -> bytes | None:
    """The file at URL path ``path`` under ``folder``; None when missing. A path leaving the folder is None."""
    rel = PurePosixPath(urllib.request.url2pathname(path).lstrip("/"))
    if ".." in rel.parts:
        return None
    target = Path(folder) / rel
    return target.read_bytes() if target.is_file() else None


SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"


def parse_cutoff(value: str) -> datetime:
    """An ``exclude-newer`` cutoff (``2025-07-01`` or ``2025-07-01T00:00:00Z``; a date is its first instant, UTC).

    Raises:
        ValueError: not an ISO 8601 date or date-time (the message names the expected form).
    """
    try:
        when = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(f"{value!r} is not a cutoff: expected an ISO 8601 date or date-time in UTC, e.g. "
                         "2025-07-01 or 2025-07-01T00:00:00Z") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _version(filename: str) -> str:
    """The version a distribution's file name carries (``pkg-1.2-py3-none-any.whl``, ``pkg-1.2.tar.gz``)."""
    if filename.endswith(".whl"):
        return filename.split("-")[1] if filename.count("-") >= 4 else ""
    stem = re.sub(r"\.(tar\.gz|tar\.bz2|tar\.xz|zip|tgz|egg)$", "", filename)
    return stem.rsplit("-", 1)[1] if "-" in stem else ""


def page_before(page: dict, cutoff: datetime) -> dict:
    """A PEP 691 project page without the files uploaded at or after ``cutoff`` (or without ``upload-time``).

    ``versions`` (PEP 700) keeps the versions that still have a file.
    """
    files = []
    for f in page.get("files", []):
        uploaded = f.get("upload-time")
        if uploaded and parse_cutoff(uploaded) < cutoff:
            files.append(f)
    kept = {_version(f["filename"]) for f in files}
    out = {**page, "files": files}
    if "versions" in page:
        out["versions"] = [v for v in page["versions"] if v in kept]
    return out


def page_html(page: dict) -> bytes:
    """A PEP 691 project page as the PEP 503 HTML a client without JSON support reads.

    Hashes, requires-python, yanked and core metadata become PEP 503/592/658/714 attributes.
    """
    links = []
    for f in page.get("files", []):
        href = f["url"] + "".join(f"#{k}={v}" for k, v in list(f.get("hashes", {}).items())[:1])
        attrs = f'href="{html.escape(href)}"'
        if f.get("requires-python"):
            attrs += f' data-requires-python="{html.escape(f["requires-python"])}"'
        if f.get("yanked"):
            reason = f["yanked"] if isinstance(f["yanked"], str) else ""
            attrs += f' data-yanked="{html.escape(reason)}"'
        meta = f.get("core-metadata", f.get("dist-info-metadata"))
        if isinstance(meta, dict) and meta:
            k, v = next(iter(meta.items()))
            attrs += f' data-core-metadata="{k}={v}" data-dist-info-metadata="{k}={v}"'
        elif meta is True:
            attrs += ' data-core-metadata="true" data-dist-info-metadata="true"'
        links.append(f"<a {attrs}>{html.escape(f['filename'])}</a><br/>")
    name = html.escape(page.get("name", ""))
    return (f'<!DOCTYPE html>\n<html><head><meta name="pypi:repository-version" content="1.1">'
            f"<title>Links for {name}</title></head><body><h1>Links for {name}</h1>\n"
            + "\n".join(links) + "\n</body></html>\n").encode()


def index_page_before(url: str, cutoff: datetime, accept: str, cafile: str | None) -> tuple[bytes, str, int]:
    """The project page at ``url`` without files uploaded at or after ``cutoff``: (body, content type, files left out).

    JSON when ``accept`` names :data:`SIMPLE_JSON`, else PEP 503 HTML.

    Raises:
        urllib.error.HTTPError: the index answered with an error (a missing project is its ``404``).
        urllib.error.URLError: the index is unreachable.
    """
    page = json.loads(fetch(url, cafile, accept=SIMPLE_JSON))
    kept = page_before(page, cutoff)
    dropped = len(page.get("files", [])) - len(kept["files"])
    if SIMPLE_JSON in accept:
        return json.dumps(kept).encode(), SIMPLE_JSON, dropped
    return page_html(kept), "text/html", dropped
