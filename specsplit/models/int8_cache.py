"""A model's int8 weight codes kept beside it, so a worker's next start packs them instead of
quantizing every Linear layer again (the 1.5B target spent most of its start there; docs/results.md).

``<model dir>/int8-<kernel>-<weights' dtype>-v<FORMAT>.safetensors`` holds
``specsplit.models.int8.weight_codes`` of every Linear layer, loaded in that dtype, by module
name (``<name>.codes``, ``<name>.scale``); its metadata names the format, the kernel and the
source (``source_fingerprint``: the directory's weight files and config, hashed). A file whose
metadata, names or shapes do not match is not used, and the quantization it did not spare writes
a fresh one; a file that cannot be read or written costs time, never a start. The file is
written as the layers are quantized (its header first: every shape is known up front, so no
layer's codes wait in memory for the others) into a temporary file renamed when complete: a
worker starting beside another reads a whole file or none. Read back through the safetensors
library, which checks the layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import torch

from specsplit.models.fsutil import DISK_MARGIN_BYTES, MANIFEST_NAME, temp_sibling

FORMAT = 1
_DTYPES = {torch.int8: "I8", torch.float32: "F32", torch.float64: "F64"}


def cache_path(model_dir: Path, kernel: str, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The codes of the weights of ``model_dir`` loaded in ``dtype`` (a float32 checkpoint loaded
    in bf16 quantizes other values), for ``kernel``."""
    return Path(model_dir) / f"int8-{kernel}-{str(dtype).removeprefix('torch.')}-v{FORMAT}.safetensors"


def source_fingerprint(model_dir: Path) -> str | None:
    """A hash of the weights ``model_dir`` holds (each ``*.safetensors`` file but our own: name,
    size, inode, modification and change times: a file written or replaced in any way changes it)
    and of its ``config.json`` and provisioning manifest (the source's sha256 where
    ``specsplit models pull`` made it); None without weight files."""
    model_dir = Path(model_dir)
    files = sorted(p for p in model_dir.glob("*.safetensors") if not p.name.startswith("int8-"))
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.name}\0{st.st_size}\0{st.st_ino}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n".encode())
    for name in ("config.json", MANIFEST_NAME):
        if (model_dir / name).exists():
            h.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
    return h.hexdigest()


class Int8Codes:
    """The codes of one model directory, kernel and weights' dtype: ``get`` a layer's from the
    file (None where it has none), ``put`` each layer's as it is quantized when the file was not
    usable (in the order ``layers`` gave), ``close`` to finish. ``layers``: [(name, {"codes":
    shape, "scale": shape})] of every layer, in quantization order; ``dtypes``: each part's dtype;
    ``weights``: the dtype the layers' weights were loaded in. ``status``: "hit" (every layer
    read), "written", "unwritable" (the directory or disk refused; quantized as without a cache),
    "stale" (found but not usable, and not rewritten) or "miss" (no weight files to key it by)."""

    def __init__(self, model_dir: Path, kernel: str, layers: list[tuple[str, dict[str, tuple[int, ...]]]],
                 dtypes: dict[str, torch.dtype], weights: torch.dtype):
        self.path, self.kernel, self.layers = cache_path(model_dir, kernel, weights), kernel, layers
        self.dtypes = dtypes
        self.parts = dict(layers)
        self.source = source_fingerprint(model_dir)
        self.status = "miss"
        self._file = None  # safe_open handle of a usable file
        self._writer: _Writer | None = None
        if self.source is not None:
            self._open()

    def _meta(self) -> dict[str, str]:
        return {"format": str(FORMAT), "kernel": self.kernel, "source": self.source}

    def _open(self) -> None:
        if not self.path.exists():
            return
        try:
            from safetensors import safe_open

            f = safe_open(str(self.path), framework="pt")
            ok = f.metadata() == self._meta() and all(
                f.get_slice(f"{name}.{part}").get_shape() == list(shape)
                for name, parts in self.layers for part, shape in parts.items())
        except Exception:  # unreadable, truncated, another layout: quantized as without it
            ok = False
        if ok:
            self._file = f
            self.status = "hit"
        else:
            self.status = "stale"

    def get(self, name: str) -> dict[str, torch.Tensor] | None:
        if self._file is None:
            return None
        return {part: self._file.get_tensor(f"{name}.{part}") for part in self.parts[name]}

    def put(self, name: str, codes: dict[str, torch.Tensor]) -> None:
        """The codes of layer ``name``, just quantized (layers in order); kept on disk only when
        the file was missing or stale."""
        if self._file is not None or self.source is None or self.status == "unwritable":
            return
        try:
            if self._writer is None:
                entries = [(f"{n}.{part}", self.dtypes[part], shape) for n, parts in self.layers
                           for part, shape in parts.items()]
                self._writer = _Writer(self.path, self._meta(), entries)
            for part in self.parts[name]:
                self._writer.write(f"{name}.{part}", codes[part])
        except (OSError, ValueError):  # a full disk, a read-only directory: the start goes on without it
            self._abandon()

    def close(self) -> None:
        """Finish: rename a complete written file into place (an incomplete one is removed)."""
        if self._writer is not None:
            try:
                self._writer.commit()
                self.status = "written"
            except OSError:
                self._abandon()
        self._file = None

    def _abandon(self) -> None:
        if self._writer is not None:
            self._writer.discard()
            self._writer = None
        self.status = "unwritable"


def _remove_dead_temps(path: Path) -> None:
    """Temporaries of ``path`` whose writer process is gone (killed mid-write); a live one's stays."""
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        try:
            os.kill(int(stale.name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            stale.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            pass


class _Writer:
    """A safetensors file written tensor by tensor: the header (every name, dtype, shape and
    offset) first, then each tensor's bytes in the header's order."""

    def __init__(self, path: Path, metadata: dict[str, str], entries: list[tuple[str, torch.dtype, tuple]]):
        self.path, self.order, self.next = path, [name for name, _, _ in entries], 0
        header: dict = {"__metadata__": metadata}
        offset = 0
        self.sizes = {}
        for name, dtype, shape in entries:
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.sizes[name] = (dtype, tuple(shape), size)
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
        _remove_dead_temps(path)
        if shutil.disk_usage(path.parent).free < offset + DISK_MARGIN_BYTES:
            raise OSError(f"int8 cache: {offset} bytes would leave {path.parent} under its margin")
        self.tmp = temp_sibling(path)
        self.f = open(self.tmp, "wb")  # noqa: SIM115 (closed by commit or discard)
        os.fchmod(self.f.fileno(), 0o644)  # readable by whoever reads the model (fsutil.replace_dir)
        self.f.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, t: torch.Tensor) -> None:
        if self.next >= len(self.order) or self.order[self.next] != name:
            raise ValueError(f"int8 cache: {name} out of order")
        dtype, shape, size = self.sizes[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"int8 cache: {name} is {t.dtype} {tuple(t.shape)}, not {dtype} {shape}")
        data = t.detach().contiguous().view(torch.uint8).reshape(-1).numpy()  # little-endian, as on x86
        assert data.nbytes == size
        self.f.write(memoryview(data))
        self.next += 1

    def commit(self) -> None:
        if self.next != len(self.order):
            raise OSError(f"int8 cache: {len(self.order) - self.next} tensors never written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        try:
            self.f.close()
        finally:
            self.tmp.unlink(missing_ok=True)
