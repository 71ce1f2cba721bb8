"""Getting every rank the same 128-byte NCCL unique id (docs/ep.md §7), then a Communicator.

Each helper returns the id (bytes); :func:`init_communicator` picks one from the environment and builds
the :class:`moe_rt.Communicator`. Rank 0 makes the id with :func:`moe_rt.get_unique_id`, which (without
``NCCL_COMM_ID``) starts NCCL's bootstrap listener in rank 0's process: rank 0 must live until every rank
has created its communicator.

- :func:`unique_id_from_env`: ``NCCL_COMM_ID=host:port`` set on every rank: no exchange; every rank calls
  ``ncclGetUniqueId``, which then encodes that address, the same on all ranks (NCCL's documented mode).
- :func:`unique_id_from_store`: a ``torch.distributed`` store (``set``/``get``; ``get`` blocks).
- :func:`unique_id_from_jax`: jax.distributed's key-value store (after ``jax.distributed.initialize``).
- :func:`unique_id_from_mpi`: mpi4py's broadcast (``MPI.COMM_WORLD`` unless given).
- :func:`unique_id_from_file`: a shared file: rank 0 writes it atomically (temp file + ``os.replace``),
  the others poll it until ``timeout``.
"""
from __future__ import annotations

import os
import tempfile
import time

from moe_rt._comm import get_unique_id

__all__ = ["unique_id_from_env", "unique_id_from_store", "unique_id_from_jax", "unique_id_from_mpi",
           "unique_id_from_file", "share_bytes_via_file", "init_communicator"]

UID_BYTES = 128
_KEY = "moe_rt_nccl_uid"


def _check_uid(uid, where):
    if not isinstance(uid, (bytes, bytearray)) or len(uid) != UID_BYTES:
        raise RuntimeError(f"{where}: expected a {UID_BYTES}-byte NCCL unique id, got "
                           f"{type(uid).__name__} of length {len(uid) if hasattr(uid, '__len__') else '?'}")
    return bytes(uid)


def unique_id_from_env() -> bytes:
    """The id for ``NCCL_COMM_ID=host:port`` (set identically on every rank); no exchange needed."""
    if not os.environ.get("NCCL_COMM_ID"):
        raise RuntimeError("NCCL_COMM_ID is not set")
    return _check_uid(get_unique_id(), "ncclGetUniqueId")


def unique_id_from_store(store, rank: int, *, key: str = _KEY) -> bytes:
    """Rank 0 puts a fresh id in a ``torch.distributed`` store (``TCPStore``, ``FileStore``, or
    ``dist.distributed_c10d._get_default_store()``); the others ``get`` it (blocking, the store's timeout)."""
    if rank == 0:
        uid = get_unique_id()
        store.set(key, uid)
        return uid
    return _check_uid(bytes(store.get(key)), f"store.get({key!r})")


def unique_id_from_jax(rank: int, *, key: str = _KEY, timeout_ms: int = 120_000) -> bytes:
    """Through jax.distributed's key-value store (call ``jax.distributed.initialize()`` first)."""
    from jax._src.distributed import global_state

    client = global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized (call jax.distributed.initialize() first)")
    if rank == 0:
        uid = get_unique_id()
        client.key_value_set_bytes(key, uid)
        return uid
    return _check_uid(client.blocking_key_value_get_bytes(key, int(timeout_ms)), "jax key-value store")


def unique_id_from_mpi(comm=None, root: int = 0) -> bytes:
    """Broadcast from ``root`` with mpi4py (``MPI.COMM_WORLD`` by default)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    uid = get_unique_id() if comm.Get_rank() == root else None
    return _check_uid(comm.bcast(uid, root=root), "MPI bcast")


def share_bytes_via_file(path, rank: int, make=None, *, timeout: float = 120.0, poll: float = 0.01) -> bytes:
    """Rank 0 writes ``make()`` (bytes) to ``path`` atomically; other ranks poll until it appears (at most
    ``timeout`` seconds, then TimeoutError) and read it. Returns the bytes on every rank."""
    path = os.fspath(path)
    if rank == 0:
        data = bytes(make())
        d = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".moe_rt_uid.", dir=d)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return data
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path, "rb") as f:
                data = f.read()
            if data:
                return data
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: {path} did not appear within {timeout:g} s (is rank 0 running?)")
        time.sleep(poll)


def unique_id_from_file(path, rank: int, *, timeout: float = 120.0) -> bytes:
    """The shared-file exchange of the id (``path`` on a file system every rank sees; a fresh path per
    job, e.g. ``MOE_RT_UID_FILE`` from ``tools/launch.py``)."""
    return _check_uid(share_bytes_via_file(path, rank, get_unique_id, timeout=timeout), str(path))


def init_communicator(rank: int | None = None, world_size: int | None = None, device: int | None = None, *,
                      method: str = "auto", store=None, timeout: float = 120.0):
    """A :class:`moe_rt.Communicator` for this process.

    ``rank``/``world_size``/``device`` default to the env ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``.
    ``method``: ``"env"`` (``NCCL_COMM_ID``), ``"file"`` (``MOE_RT_UID_FILE``), ``"store"`` (``store`` or
    torch.distributed's default store), ``"jax"``, ``"mpi"``, or ``"auto"``: the first of env, file, store
    (when torch.distributed is initialized), jax (when initialized), mpi (when mpi4py imports).
    """
    from moe_rt._comm import Communicator

    rank = _env_int("RANK", "rank") if rank is None else int(rank)
    world_size = _env_int("WORLD_SIZE", "world_size") if world_size is None else int(world_size)
    device = (int(rank) if "LOCAL_RANK" not in os.environ else _env_int("LOCAL_RANK", "device")) \
        if device is None else int(device)
    if method == "auto":
        method = _auto_method(store)
    if method == "env":
        uid = unique_id_from_env()
    elif method == "file":
        path = os.environ.get("MOE_RT_UID_FILE")
        if not path:
            raise RuntimeError("method='file' needs MOE_RT_UID_FILE")
        uid = unique_id_from_file(path, rank, timeout=timeout)
    elif method == "store":
        if store is None:
            import torch.distributed as dist

            store = dist.distributed_c10d._get_default_store()
        uid = unique_id_from_store(store, rank)
    elif method == "jax":
        uid = unique_id_from_jax(rank, timeout_ms=int(timeout * 1000))
    elif method == "mpi":
        uid = unique_id_from_mpi()
    else:
        raise ValueError(f"method: expected auto, env, file, store, jax or mpi, got {method!r}")
    return Communicator(uid, rank, world_size, device)


def _env_int(var: str, arg: str) -> int:
    """An int from the environment for the argument ``arg`` of init_communicator, or a ValueError that names
    both (a launcher such as torchrun or tools/launch.py sets RANK, WORLD_SIZE and LOCAL_RANK)."""
    text = os.environ.get(var)
    if text is None:
        raise ValueError(f"{arg}: not given and the environment variable {var} is not set; pass rank= and "
                         "world_size= (and device=), or set RANK and WORLD_SIZE (and LOCAL_RANK) as a launcher "
                         "such as torchrun or tools/launch.py does")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{arg}: the environment variable {var} must be an integer, got {text!r}") from None


def _auto_method(store):
    if os.environ.get("NCCL_COMM_ID"):
        return "env"
    if os.environ.get("MOE_RT_UID_FILE"):
        return "file"
    if store is not None:
        return "store"
    try:
        import sys

        if "torch" in sys.modules:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return "store"
    except Exception:
        pass
    try:
        from jax._src.distributed import global_state

        if global_state.client is not None:
            return "jax"
    except Exception:
        pass
    try:
        import mpi4py  # noqa: F401

        return "mpi"
    except ImportError:
        pass
    raise RuntimeError("no way to share the NCCL unique id: set NCCL_COMM_ID or MOE_RT_UID_FILE, initialize "
                       "torch.distributed or jax.distributed, or install mpi4py")
