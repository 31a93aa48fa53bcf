"""SIGTERM/SIGINT become a stop request; a second signal stops at once; handlers are restored."""
from __future__ import annotations

import os
import signal
import time

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


def test_a_stop_raised_inside_a_destructor_is_not_lost(capfd):
    """A signal handled while a __del__ or a weakref callback runs (a garbage collection) raised StopNow there,
    where Python prints "Exception ignored" with a traceback and goes on: the run finished as if no signal
    came (issue 31's campaign). The signal is sent again and the stop comes at the next ordinary line."""
    from rptrain.train.signals import StopNow

    class SignalledWhileCollected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100):  # the handler runs here, inside __del__
                pass

    ran_on = False
    with pytest.raises(StopNow):
        with stop_on_signals(immediate=True) as stop:
            obj = SignalledWhileCollected()
            del obj
            time.sleep(5)  # the signal is sent again within milliseconds: the stop comes here
            ran_on = True
    assert not ran_on and stop.signum == signal.SIGINT
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err and err.count("SIGINT received") == 1, err
