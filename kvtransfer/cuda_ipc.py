"""CUDA IPC: prefill workers on a decode worker's node write KV blocks straight into its GPU pool.

Lifecycle: the decode worker `CudaKVPool.create`s its pool once, as one dedicated cudaMalloc made
through cupy (so the IPC handle's base is the pool's first byte and no caching allocator owns
it), and hands `CudaKVPool.accept()` (handle, offset, PCI bus id, shape, dtype) to its KVReceiver,
which answers every prefill worker's KVConnect with it. A prefill worker `IpcPeer.open`s that
answer once per destination (cudaIpcOpenMemHandle on the GPU with that bus id) and per hand-off
`IpcPeer.send` copies the granted blocks device-to-device on a side stream, records a CUDA event,
waits on it (bounded) and only then delivers KVReady, so the decode side never reads a block
before its bytes are in place. `IpcPeer.close` unmaps; `CudaKVPool.close` frees the allocation
when the decode worker exits. cupy is imported inside functions only: this module imports, and
its CPU paths run, on machines with neither a GPU nor cupy.

Tensor-parallel GPU workers: each rank's pool is a CudaKVPool on its GPU holding its KV heads;
rank 0 maps the others' (`map_export`) and its KVAccept lists every rank's export (`ipc_parts`).
A prefill worker maps each part and copies each decode rank's heads straight from whichever of
its own ranks' pools hold them (kvtransfer.heads.copy_heads), on a side stream per GPU involved.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from pdserve.common.errors import NotSupportedError
from pdserve.kvtransfer.errors import KVTransferError, wait_done
from pdserve.kvtransfer.heads import HeadParts, as_parts, copy_heads
from pdserve.kvtransfer.pool import DTYPES, KVPool, dtype_name
from pdserve.wire.protocol import KVAccept


def require_cupy():
    """The cupy module, or NotSupportedError naming the missing piece."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a cupy built for another CUDA failing to load
        raise NotSupportedError(f"the GPU kv backends need cupy (pip install -e '.[gpu]'): {e}") from e
    return cupy


@functools.cache
def has_cupy() -> bool:
    try:
        require_cupy()
    except NotSupportedError:
        return False
    return True


def pci_bus_id(device: torch.device) -> str:
    """The PCI bus id of a CUDA device: the same GPU in every process, whatever its ordinal there."""
    cupy = require_cupy()
    return cupy.cuda.runtime.deviceGetPCIBusId(_index(device))


def local_device(bus_id: str) -> torch.device:
    cupy = require_cupy()
    return torch.device("cuda", cupy.cuda.runtime.deviceGetByPCIBusId(bus_id))


def device_id(tensor: torch.Tensor) -> str:
    """What a Hello says about where a KV pool lives: "" on the CPU, else the GPU's PCI bus id."""
    if not tensor.is_cuda:
        return ""
    return pci_bus_id(tensor.device) if has_cupy() else str(tensor.device)


def gpu_pool(shape, dtype: torch.dtype, device):
    """A decode worker's KV pool on `device`: exportable (CudaKVPool) with cupy, else plain (tcp only)."""
    if has_cupy():
        return CudaKVPool.create(shape, dtype, device)
    return KVPool(torch.zeros(shape, dtype=dtype, device=device))


def _index(device: torch.device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def _wrap(ptr: int, nbytes: int, owner, device: torch.device, shape, dtype: torch.dtype) -> torch.Tensor:
    """A torch view (shape, dtype) of nbytes of device memory at ptr; `owner` stays alive with it."""
    cupy = require_cupy()
    index = _index(device)
    with cupy.cuda.Device(index):  # the DLPack hand-over orders cupy's stream of this GPU, whatever GPU is current
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device_id=index)
        flat = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
        # cupy has no bfloat16: share bytes through DLPack, then reinterpret in torch.
        return torch.from_dlpack(flat).view(dtype).view(shape)


class CudaKVPool:
    """The decode worker's KV pool on its GPU, exportable over CUDA IPC (same interface as KVPool)."""

    def __init__(self, tensor: torch.Tensor, memory, device: torch.device):
        self.tensor = tensor  # (layers, 2, num_blocks, block_size, KVH, D)
        self.memory = memory  # the cupy allocation; freed when the last reference goes
        self.device = device
        self.path = ""  # not in /dev/shm: the shm backend never applies
        self.owner = True

    @classmethod
    def create(cls, shape, dtype: torch.dtype, device) -> CudaKVPool:
        cupy = require_cupy()
        device = torch.device("cuda", _index(device))
        nbytes = _nbytes(shape, dtype)
        with cupy.cuda.Device(device.index):
            memory = cupy.cuda.Memory(nbytes)  # one cudaMalloc, not the memory pool: its handle's base is ours
        tensor = _wrap(memory.ptr, nbytes, memory, device, shape, dtype)
        tensor.zero_()  # an unwritten page must be harmless if read
        return cls(tensor, memory, device)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def accept(self, nonce: int = 0) -> KVAccept:
        """What a prefill worker needs to map this pool (the KVReceiver adds the rest of its description)."""
        cupy = require_cupy()
        handle = cupy.cuda.runtime.ipcGetMemHandle(self.memory.ptr)
        return KVAccept(nonce, list(self.tensor.shape), dtype_name(self.tensor.dtype), device=pci_bus_id(self.device),
                        ipc_handle=bytes(handle), ipc_offset=0)

    def close(self) -> None:
        # The allocation lives while any view of it does; drop ours, the worker drops the engine.
        self.owner = False


class IpcPeer:
    """A prefill worker's mapping of one decode worker's pool, and the copy into it."""

    def __init__(self, dst: torch.Tensor, timeout: float, closer=None):
        self.dst = dst  # (layers, 2, num_blocks, block_size, KVH, D), the decode worker's pool
        self.timeout = timeout
        self.closer = closer
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    @classmethod
    def open(cls, accept: KVAccept, timeout: float) -> IpcPeer:
        """Map the pool an answer describes: its one allocation, or each rank's part (ipc_parts)."""
        require_cupy()
        parts = accept.ipc_parts or ([(accept.device, accept.ipc_handle, accept.ipc_offset)] if accept.ipc_handle else [])
        if accept.kv_dtype not in DTYPES or not parts or len(accept.kv_shape) != 6 or accept.kv_shape[4] % len(parts):
            raise KVTransferError(f"cuda_ipc: unusable pool export (dtype {accept.kv_dtype!r}, {len(parts)} parts)")
        shape = [*accept.kv_shape[:4], accept.kv_shape[4] // len(parts), accept.kv_shape[5]]
        mapped, closers = [], []
        try:
            for bus_id, handle, offset in parts:
                tensor, closer = map_export(bus_id, handle, offset, shape, DTYPES[accept.kv_dtype])
                mapped.append(tensor)
                closers.append(closer)
        except BaseException:
            for closer in closers:
                closer()
            raise

        def close():
            for closer in closers:
                closer()

        return cls(mapped[0] if len(mapped) == 1 else HeadParts(mapped), timeout, close)

    def check(self, src) -> None:
        if src.shape[:2] != self.dst.shape[:2] or src.shape[3:] != self.dst.shape[3:] or src.dtype != self.dst.dtype:
            raise KVTransferError(f"pool {tuple(src.shape)} {src.dtype} cannot fill destination {tuple(self.dst.shape)} {self.dst.dtype}")

    def send(self, src, src_ids: list[int], dst_ids: list[int], deliver) -> None:
        """Copy src's blocks into dst_ids (each destination rank's heads from the source ranks that
        hold them), wait until they are in place, then deliver() the header."""
        self.check(src)
        if not src.is_cuda:  # the CPU tests' stand-in for a mapped pool
            copy_heads(self.dst, src, src_ids, dst_ids)
            deliver()
            return
        # every GPU a copy touches gets a side stream: a copy between GPUs runs on its source's,
        # and one into a strided view of another GPU's part finishes on that GPU's current stream
        devices = list(dict.fromkeys(p.device for p in (*as_parts(src), *as_parts(self.dst))))
        streams = [self._stream(d) for d in devices]
        with contextlib.ExitStack() as on:
            for d, stream in zip(devices, streams):
                stream.wait_stream(torch.cuda.current_stream(d))  # the prefill forward that wrote src
                on.enter_context(torch.cuda.stream(stream))
            copy_heads(self.dst, src, src_ids, dst_ids)
            events = [torch.cuda.Event() for _ in streams]
            for event, stream in zip(events, streams):
                event.record(stream)
        for event in events:
            wait_done(event, self.timeout, f"cuda_ipc copy of {len(src_ids)} blocks")
        deliver()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = torch.cuda.Stream(device)
        return stream

    def close(self) -> None:
        self.dst = None
        if self.closer is not None:
            self.closer()
            self.closer = None


def map_export(bus_id: str, handle: bytes, offset: int, shape, dtype: torch.dtype):
    """(a tensor over another process's exported pool, its unmap function) on the GPU bus_id names."""
    cupy = require_cupy()
    device = local_device(bus_id)
    with cupy.cuda.Device(device.index):
        base = cupy.cuda.runtime.ipcOpenMemHandle(handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
    tensor = _wrap(base + offset, _nbytes(shape, dtype), None, device, shape, dtype)

    def close():
        with cupy.cuda.Device(device.index):
            cupy.cuda.runtime.ipcCloseMemHandle(base)

    return tensor, close


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()
