"""Task images to the Docker engines of other nodes without a registry: once to S3 by id, once per engine.

A node's engine has none of the images the flow machine built. :func:`stage_images` saves each
(``docker save``, tagged) to ``<images dir>/<image id>.tar`` unless an archive of that id is already
there, so an image is uploaded once whatever the number of runs and nodes; :func:`ensure_images`, on
the node, loads (``docker load``) each archive whose id its engine lacks and checks the id it got.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable


def stage_images(fs, client, refs: Iterable[str], images_dir: str) -> dict[str, tuple[str, str]]:
    """Save every image ``ref`` on ``client``'s engine to S3 (skipping ids already there).

    Args:
        fs: an s3fs filesystem.
        client: the docker SDK client of the engine that has the images.
        refs: image tags (or ids) to stage.
        images_dir: an s3fs path (``bucket/prefix/images``).

    Returns:
        ref -> (image id ``sha256:…``, archive path).

    Raises:
        docker.errors.ImageNotFound: a ref that engine does not have.
    """
    shipped = {}
    for ref in sorted(set(refs)):
        image = client.images.get(ref)
        archive = f"{images_dir}/{image.id.removeprefix('sha256:')}.tar"
        if not fs.exists(archive):
            partial = f"{archive}.partial-{uuid.uuid4().hex[:8]}"  # never read: only a complete archive is named
            with fs.open(partial, "wb") as out:
                for chunk in image.save(named=ref):
                    out.write(chunk)
            fs.mv(partial, archive)
        shipped[ref] = (image.id, archive)
    return shipped


def ensure_images(fs, client, shipped: dict[str, tuple[str, str]]) -> list[str]:
    """Load into ``client``'s engine each image of ``shipped`` (:func:`stage_images`) it lacks; returns their refs.

    An engine that has ``ref`` with another id (an older build) gets the shipped one, tagged ``ref``.

    Raises:
        RuntimeError: an archive loaded an image of another id than the one staged.
    """
    import docker

    loaded = []
    for ref, (image_id, archive) in sorted(shipped.items()):
        try:
            if client.images.get(ref).id == image_id:
                continue
        except docker.errors.ImageNotFound:
            pass
        with fs.open(archive, "rb") as data:
            got = client.images.load(data)
        if image_id not in {i.id for i in got}:
            raise RuntimeError(f"{archive}: loaded {[i.id for i in got]}, expected {image_id} for {ref}")
        loaded.append(ref)
    return loaded
