"""One version of the weights (``RoundPipe(single_version=...)``, host.py): the master is the host's
compute copy where their dtypes agree, one gradient buffer, the GPU share also while the model
streams, and every step synchronous. Checked against plain PyTorch's synchronous training
(tests/reference.py) at the equivalence suite's fp32 tolerance (rtol 1e-5), on the CPU and on a
SimulatedDevice that streams (the CUDA code paths on the CPU), with the memory it saves."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from reference import assert_state_close
from rptrain import RoundPipe, Tuning
from rptrain.engine import DoesNotFit, check_model_fits
from rptrain.engine.gpushare import cuts
from rptrain.engine.layout import FlatLayout
from rptrain.engine.placement import HOST
from rptrain.engine.simulated import SimulatedDevice
from test_engine_equivalence import mlp, train_both, vector_batches

STREAM = Tuning(resident_share=0.0, resident_share_gpu_state=0.0, gpu_state_reserve=0.0, streamed_gpu_state_reserve=0.0)  # never resident, no activation reserve


def state_budget(model: nn.Sequential, layers: int) -> int:
    """GPU bytes for the largest layer streamed (twice, its gradients three times: fit.py) plus the first
    ``layers`` layers' state with one version (fp32 master 4 + Adam 8 + one gradient buffer 4)."""
    weights = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model]
    return max(5 * w for w in weights) + 16 * sum(cuts(FlatLayout.of_parameters(list(model)), layers).values()) + 16


@pytest.mark.parametrize("where", ["cpu", "stream-host", "stream-split", "stream-gpu"])
def test_async_steps_train_exactly_like_synchronous_pytorch(where):
    """``is_async=True`` is synchronous with one version: the reference steps synchronously too."""
    model = mlp()
    kw = dict(devices=["cpu"]) if where == "cpu" else dict(devices=[SimulatedDevice(0)], tuning=STREAM)
    if where == "stream-host":
        kw["gpu_state"] = False
    if where == "stream-split":
        kw["max_gpu_memory"] = state_budget(model, 3)
    engine, ref = train_both(model, vector_batches(count=4), 2, delayed=False, engine_async=True, single_version=True, **kw)
    host = engine._host
    assert host.single_version and host.master_is_compute and len(host.grads) == 1
    assert not engine._executor.resident
    expected_gpu_layers = {"cpu": 0, "stream-host": 0, "stream-split": 4, "stream-gpu": 7}[where]
    assert engine.placement.gpu_layers == expected_gpu_layers
    assert_state_close(engine.state_dict(), ref.state())
    with torch.no_grad():  # the user's module shows the newest weights (its parameters view the master)
        for p, q in zip(engine.model.parameters(), ref.master.parameters()):
            torch.testing.assert_close(p.detach(), q.detach().to(p.dtype), rtol=1e-5, atol=1e-6)


def test_memory_one_version_against_two():
    """The host keeps no compute copy (the master is it) and one gradient buffer; fit.py predicted the same."""
    model = mlp()
    engines = {single: RoundPipe(model, devices=[SimulatedDevice(0)], tuning=STREAM, gpu_state=False, single_version=single)
               for single in (False, True)}
    for single, engine in engines.items():
        x, y = vector_batches(count=1)[0]
        engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss())
        engine.step(lambda: None, is_async=True)
        engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss())
        engine.synchronize()
    two, one = (engines[s].memory_report() for s in (False, True))
    assert one["master"] == two["master"] > 0
    assert one["compute"] == 0 and two["compute"] >= 2 * 4 * sum(p.numel() for p in model.parameters())  # two copies, alignment included
    assert two["grads"] == 2 * one["grads"] == 2 * one["master"]  # the async steps allocated the second buffer
    for single, report in ((False, two), (True, one)):
        predicted = engines[single].placement.totals[HOST]
        assert (predicted["master"], predicted["grads"], predicted["compute"]) == (report["master"], report["grads"], report["compute"])


def test_bf16_model_with_fp32_master_keeps_one_compute_copy():
    model = mlp().to(torch.bfloat16)
    engine = RoundPipe(model, optim_dtype=torch.float32, single_version=True, devices=["cpu"])  # (a GPU keeps no host copies)
    host = engine._host
    assert not host.master_is_compute and host.compute[0] is host.compute[1]
    one_copy = sum(n * host.params.dtypes[k].itemsize for k, n in host.host.sizes.items())  # bf16, alignment included
    assert one_copy >= 2 * sum(p.numel() for p in model.parameters()) and engine.memory_report()["compute"] == one_copy
    assert engine.placement.totals[HOST]["compute"] == engine.memory_report()["compute"]


def test_auto_takes_one_version_only_where_two_do_not_fit():
    model = mlp()
    need = {single: RoundPipe(model, devices=[SimulatedDevice(0)], tuning=STREAM, gpu_state=False, single_version=single).placement.total(HOST)
            for single in (False, True)}
    assert need[True] < need[False]
    roomy = RoundPipe(model, devices=[SimulatedDevice(0)], tuning=STREAM, gpu_state=False, max_host_memory=need[False])
    tight = RoundPipe(model, devices=[SimulatedDevice(0)], tuning=STREAM, gpu_state=False, max_host_memory=need[False] - 1)
    assert not roomy._host.single_version and tight._host.single_version
    assert not roomy.placement.single_version and tight.placement.single_version
    assert "one version of the weights" in str(tight.placement) and "one version" not in str(roomy.placement)
    with pytest.raises(DoesNotFit, match="does not fit with one version of the weights"):
        RoundPipe(model, devices=[SimulatedDevice(0)], tuning=STREAM, gpu_state=False, max_host_memory=need[True] - 1)
    with pytest.raises(DoesNotFit, match=r"does not fit: "):  # two versions asked for: their numbers
        RoundPipe(model, devices=[SimulatedDevice(0)], tuning=STREAM, gpu_state=False, max_host_memory=need[True], single_version=False)


def test_single_version_must_be_a_bool():
    with pytest.raises(TypeError, match="single_version must be True, False or None"):
        RoundPipe(mlp(), single_version="yes")


def test_a_synchronous_step_takes_every_core():
    """With one version and steps the next call does not overlap the issuing thread waits for the step, so the
    optimizer thread takes its core too; a step the next call overlaps (Tuning.step_overlap) leaves it that core."""
    overlapping, waiting = replace(STREAM, step_overlap=True), replace(STREAM, step_overlap=False)
    threads = {(single, tuning.step_overlap): RoundPipe(mlp(), devices=[SimulatedDevice(0)], tuning=tuning,
                                                        single_version=single)._versions.thread._threads
               for single in (False, True) for tuning in (overlapping, waiting)}
    fewer = max(1, torch.get_num_threads() - 1)
    assert threads == {(False, True): fewer, (False, False): fewer, (True, True): fewer, (True, False): torch.get_num_threads()}
    # Resident weights: no call overlaps a step (versions.py), so a synchronous step keeps every core there.
    resident = RoundPipe(mlp(), devices=[SimulatedDevice(0)], tuning=replace(RESIDENT, step_overlap=True), single_version=True)
    assert not resident._versions.overlaps(True) and resident._versions.thread._threads == torch.get_num_threads()


RESIDENT = Tuning(resident_share=1.0, resident_share_gpu_state=1.0, gpu_state_reserve=0.0, streamed_gpu_state_reserve=0.0)  # resident wherever allowed


def gpu_budgets(model: nn.Sequential) -> tuple[int, int]:
    """(a GPU budget where one version streamed keeps every layer's state on the GPU and two versions
    resident do not; one where two versions resident keep it all too), found by the fit check alone."""
    def host_params(budget: int, single: bool) -> int:
        try:
            return check_model_fits(model, devices=[SimulatedDevice(0)], tuning=RESIDENT, max_gpu_memory=budget,
                                    single_version=single).params_on(HOST)
        except DoesNotFit:
            return -1
    budgets = range(1 << 12, 1 << 20, 1 << 10)
    split = next(b for b in budgets if host_params(b, True) == 0 and host_params(b, False) > 0)
    roomy = next(b for b in budgets if host_params(b, False) == 0)
    return split, roomy


def test_auto_takes_one_version_where_it_keeps_more_state_on_the_gpu():
    """Two versions where they keep the state on the GPU; one (streamed) where two would step on the host
    what one keeps on the GPU: a synchronous step then beats an asynchronous host step (Tuning.one_version_host_share)."""
    model = mlp()
    split, roomy = gpu_budgets(model)
    engine, _ = train_both(model, vector_batches(count=3), 2, delayed=False, engine_async=True,
                           devices=[SimulatedDevice(0)], tuning=RESIDENT, max_gpu_memory=split)
    assert engine._host.single_version and engine.placement.params_on(HOST) == 0
    assert not engine._executor.resident  # one version streams: its GPU share's master is the compute copy
    assert "Tuning.one_version_host_share" in str(engine.placement)
    kept = RoundPipe(mlp(), devices=[SimulatedDevice(0)], tuning=RESIDENT, max_gpu_memory=roomy)
    assert not kept._host.single_version and kept.placement.params_on(HOST) == 0
    never = Tuning(resident_share=1.0, resident_share_gpu_state=1.0, gpu_state_reserve=0.0, streamed_gpu_state_reserve=0.0, one_version_host_share=0.0)
    two = RoundPipe(mlp(), devices=[SimulatedDevice(0)], tuning=never, max_gpu_memory=split)
    assert not two._host.single_version and two.placement.params_on(HOST) > 0
    asked = RoundPipe(mlp(), devices=[SimulatedDevice(0)], tuning=RESIDENT, max_gpu_memory=split, single_version=True)
    assert asked._host.single_version and asked.placement.params_on(HOST) == 0 and not asked._executor.resident


def test_a_streamed_placement_keeps_a_fifth_of_a_large_gpu_for_activations_but_no_less_than_the_floor():
    """Where the weights stream the planner cuts stages to the memory left: 20% of an H200's free memory is kept for
    activations (Tuning.streamed_gpu_state_reserve), at least 27 GiB (an 80 GB card keeps what it was measured with),
    never more than a resident model's 35%."""
    from rptrain.engine.gpushare import gpu_state_allowed

    GiB, tuning = 2**30, Tuning()
    share = lambda free, resident: gpu_state_allowed(True, [SimulatedDevice(0, memory=int(free))], resident, tuning, True)[1]  # noqa: E731
    assert share(139 * GiB, resident=False) == tuning.streamed_gpu_state_reserve == 0.2
    assert share(80 * GiB, resident=False) * 80 * GiB == tuning.streamed_reserve_floor == 27 * GiB
    assert share(40 * GiB, resident=False) == share(139 * GiB, resident=True) == tuning.gpu_state_reserve == 0.35
