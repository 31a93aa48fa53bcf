"""SIGTERM/SIGINT become a stop request; a second signal stops at once; handlers are restored."""
from __future__ import annotations

import os
import signal

import pytest

from rptrain.train.signals import stop_on_signals


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_sets_the_request_instead_of_killing(signum, code):
    before = signal.getsignal(signum)
    with stop_on_signals() as stop:
        assert not stop
        os.kill(os.getpid(), signum)
        assert stop and stop.signum == signum and stop.exit_code == code
        assert stop.name == signal.Signals(signum).name
    assert signal.getsignal(signum) is before


def test_a_second_signal_stops_immediately():
    with pytest.raises(KeyboardInterrupt):
        with stop_on_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)


def test_immediate_stops_outside_deferred_windows_only():
    from rptrain.train.signals import StopNow

    with stop_on_signals(immediate=True) as stop:
        with stop.deferred():  # a training step: only the flag
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
    with pytest.raises(StopNow):
        with stop_on_signals(immediate=True) as stop:
            with stop.deferred(then_stop=True):  # a checkpoint write: finished, then the stop
                os.kill(os.getpid(), signal.SIGTERM)
                assert stop
    with pytest.raises(StopNow):
        with stop_on_signals(immediate=True):  # anywhere else: at once
            os.kill(os.getpid(), signal.SIGINT)
            raise AssertionError("not reached")
