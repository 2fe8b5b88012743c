"""The Jupyter kernels a run starts: ipykernel on this interpreter by default, checked by name
otherwise, and shut down so that none outlives its notebook (after a timeout, Ctrl-C or SIGTERM
too). While a kernel runs, its peak RSS (with its children's) is sampled
(:class:`~ssmkit.workbook.memory.PeakRSS`); :func:`end_kernels` returns it.

jupyter_client, ipykernel and zmq are imported only here, and only when a notebook runs.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile

from .memory import PeakRSS
from .notebooks import WorkbookError

__all__ = ["check_kernel", "end_kernels", "kernel_manager_class"]


def check_kernel(name: str) -> None:
    """:class:`WorkbookError` unless a Jupyter kernel spec called ``name`` is installed."""
    from jupyter_client.kernelspec import KernelSpecManager

    specs = KernelSpecManager().find_kernel_specs()
    if name not in specs:
        raise WorkbookError(
            f"no Jupyter kernel named {name!r}; "
            f"installed: {', '.join(sorted(specs)) or 'none'} "
            "(without --kernel: ipykernel on this Python)"
        )


def kernel_manager_class(kernel_name: str | None, started: list, env: dict | None = None):
    """The kernel manager of a run; each one is appended to ``started`` (see :func:`end_kernels`).
    ``env``: environment variables its kernels get unless this process sets them
    (``SSMKIT_PROGRESS=text``). Without ``kernel_name`` its kernel is ipykernel on *this*
    interpreter (whatever ``python3`` spec a user has). Its shutdown interrupts a busy kernel and
    lets the interrupted cell answer before asking the kernel to exit (after a timeout, Ctrl-C,
    SIGTERM) instead of racing it, which made the kernel print ZMQ errors about a closed socket;
    the kernel's own stderr goes to a temporary file, and only what it wrote before it was asked
    to stop is shown (:func:`_replay`): the rest of that noise, still seen after timeouts. Each
    kernel's memory is sampled from its start to its shutdown (``peak_rss``: bytes or None; and
    ``held_rss``, what it held when asked to shut down, after its last cell)."""
    from ipykernel.kernelspec import RESOURCES, get_kernel_dict
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpec

    class RunKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            started.append(self)
            self.sampler, self.peak_rss, self.held_rss = None, None, None
            # jupyter_client >= 8.7: CurveZMQ
            if not kernel_name and "transport_encryption" in self.trait_names():
                import zmq

                self.transport_encryption = "auto" if zmq.has("curve") else "disabled"

        @property
        def kernel_spec(self):
            return (
                super().kernel_spec
                if kernel_name
                else KernelSpec(resource_dir=RESOURCES, **get_kernel_dict())
            )

        async def start_kernel(self, **kw) -> None:
            kw["env"] = {**(env or {}), **(kw.get("env") or os.environ)}
            if "stderr" not in kw:  # the kernel's own log (not the cells': they go over ZMQ)
                self._log = tempfile.TemporaryFile()
                kw["stderr"] = self._log
            await super().start_kernel(**kw)
            pid = getattr(self.provisioner, "pid", None)  # a local kernel's process
            self.sampler = PeakRSS(pid).start() if pid else None

        def stop_sampling(self) -> None:
            if self.sampler is not None:
                peak, held = self.sampler.stop(), self.sampler.held
                self.sampler = None
                self.peak_rss = max(peak, self.peak_rss or 0) if peak is not None else self.peak_rss
                self.held_rss = held if held is not None else self.held_rss

        async def shutdown_kernel(self, now: bool = False, restart: bool = False) -> None:
            self.stop_sampling()
            log = getattr(self, "_log", None)
            kept = os.fstat(log.fileno()).st_size if log is not None else 0
            if self.has_kernel and not now:
                await self.interrupt_kernel()
                await asyncio.sleep(0.5)
            await super().shutdown_kernel(now=now, restart=restart)
            if log is not None and not restart:
                _replay(log, kept)
                self._log = None

    return RunKernelManager


def _replay(log, size: int) -> None:
    """Show the first ``size`` bytes of a kernel's stderr ``log`` -- what it wrote while it ran (a
    warning, a crash) -- on ours, then close it. What it wrote once asked to stop is dropped:
    ipykernel tears its ZMQ sockets down while a thread still uses them and logs a
    ``ZMQError: Socket operation on non-socket`` traceback, mostly after a cell timeout (issue
    #26)."""
    try:
        text = os.pread(log.fileno(), size, 0).decode("utf-8", "replace") if size else ""
    finally:
        log.close()
    if text:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()


def end_kernels(started: list) -> tuple[int | None, int | None]:
    """Kill the kernels of ``started`` still alive (a signal cut nbclient's own shutdown short);
    empties the list. Returns ``(peak, held)`` in bytes (None: unmeasured): the largest peak RSS of
    those kernels, and the most any of them still held after its last cell."""
    from jupyter_core.utils import run_sync

    peaks, held = [], []
    while started:
        km = started.pop()
        try:
            if km.has_kernel:
                run_sync(km.shutdown_kernel)(now=True)
        except Exception:  # already gone
            pass
        km.stop_sampling()
        if km.peak_rss is not None:
            peaks.append(km.peak_rss)
        if km.held_rss is not None:
            held.append(km.held_rss)
    return max(peaks, default=None), max(held, default=None)
