"""The wrapped module as the original library leaves it to its user: after ``synchronize()`` its
parameters hold the newest weights and, as ``.grad``, the gradients accumulated since the last step;
a plain optimizer that then steps those parameters is noticed at the next call and its weights adopted."""
from __future__ import annotations

from typing import Optional

from .host import HostState
from .versions import Versions


class UserModule:
    def __init__(self, host: HostState, versions: Versions):
        self.host, self.versions = host, versions
        self._synchronized: Optional[tuple[int, list[int]]] = None  # (version, the parameters' counters) at synchronize()

    def synchronize(self) -> None:
        self.versions.synchronize()
        self._show_grads()
        self._synchronized = (self.versions.written, self.host.user_param_versions())

    def adopt_user_steps(self) -> None:
        """Parameters written since ``synchronize()``, with no step of ours in between: a plain optimizer
        over the wrapped model's parameters has stepped them. They become the master (and every copy),
        and the gradients that step consumed are dropped, as the original library moves them into ``.grad``."""
        synced, self._synchronized = self._synchronized, None
        if synced is None or synced[0] != self.versions.written or synced[1] == self.host.user_param_versions():
            return
        self.host.read_user_params()
        self.versions.discard_window()
        self.synchronize()

    def _show_grads(self) -> None:
        """The wrapped model's ``.grad``: the gradients accumulated since the last step (in the
        parameter's dtype; the step still uses the fp32 sums), None where there are none."""
        buffer = self.versions.open_buffer()
        for slot, p in zip(self.host.params.slots, self.host.user_params):
            written = buffer is not None and buffer.written[slot.index]
            p.grad = buffer.views[slot.index].to(p.device, p.dtype, copy=True) if written else None
