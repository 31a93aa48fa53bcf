"""Every measured threshold of the engine in one value: ``RoundPipe(..., tuning=Tuning(...))``.

Each default says where it came from. Tests pass values here instead of patching modules.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional


@dataclass(frozen=True)
class Tuning:
    # Keep the whole model on every GPU (uploaded once per version, not once per stage) when two
    # versions of the trainable weights and one of the frozen take at most this share of the GPU.
    resident_share: float = 0.2
    # With GPU-resident optimizer state (RoundPipe(gpu_state=True)) the compute copy stays on the GPU
    # up to this share instead: the host then holds no compute copies of the GPU share and casts none.
    resident_share_gpu_state: float = 0.5
    # With RoundPipe(single_version=None), one version of the weights (synchronous steps; resident or
    # streamed, whichever keeps more state on the GPU) is chosen over two when its host steps less than this
    # share of the parameters two versions' host steps. Llama-3.1-8B with the low-memory preset on an H100
    # (bench/gpu_suite.sh preset-8b at 3af8b93, 2026-12-06, one invocation): two versions stepped 7.29 B parameters on
    # the host, 3,817 tokens/s; one version streamed 0, 8,387 tokens/s (2.2x). The 0.5 between those ends is
    # a judgement: a synchronous step exposes its host share, an asynchronous one hides up to a call of it.
    one_version_host_share: float = 0.5
    # With one version of the weights (synchronous steps) the GPU would wait while the host steps its share:
    # this share of each host run's low-precision step (bf16 master or 8-bit moments) is streamed through the
    # GPU instead, the host stepping the rest meanwhile (rptrain/optim/assist.py). Measured on an H100 machine
    # (gpu_suite assist-14b at e63aeb1, 2026-12-06, the 14 B shape's 6.9 B host parameters): the host alone 1.37 s
    # (0.20 ns a parameter); at 0.7 the step took 0.84 s (1.11x the run's tokens/s), so the GPU's part moved
    # 0.17 ns a parameter, and the two parts end together near 0.53 there; the H200 machine's host steps at
    # 0.30 ns a parameter (split-big at c8a111c), where they would at about 0.63. 0.6 lies between; 0 turns it off.
    host_step_gpu_share: float = 0.6
    # With one version and streamed weights, an asynchronous step() returns at once and the next call reads each
    # stage's weights as soon as the step has written them (rptrain/optim/front.py), so the next forward runs
    # while the host steps its share; the weights are those of a synchronous step (tests/test_engine_step_overlap.py,
    # bit for bit on and off, on an H200 too). Measured on one H200 start (gpu_suite overlap-14b and overlap-big at
    # 7f455b5, 2026-12-06, each run its own process): the 14 B shape, whose host steps only its head, 4,597 tokens/s
    # on and 4,587 off (one invocation); the 32 B shape with it and the assisted host step 1,580 (steady 1,672; the
    # 17th session's start, waiting for a host step it did not assist: 1,100). False waits for the whole step.
    step_overlap: bool = True
    # Of the GPU's free memory: kept for activations and the schedule's working set when placing the
    # optimizer state before the first call has measured them (the planner then cuts stages to what is
    # left). Llama-3B at 4 x 4096 peaked at 60 GiB on the H200 with about 25 of them weight copies;
    # Llama-3.1-8B ran out of GPU memory at 0.2 (27.8 GiB kept). On the H200 at 4 x 4096 (2026-12-04):
    # at 0.3 Llama-3.1-8B trained (11 of 34 layers' state on the GPU, peak 135.7 GiB) but Qwen3-8B ran
    # out of GPU memory (its 152k vocabulary's logits); at 0.35 both trained (peaks 131.4 and 136.8 GiB;
    # 9 and 10 layers on the GPU, 107-109 GiB of the 113 GiB host budget).
    gpu_state_reserve: float = 0.35
    # The same where the weights stream (one version: a GPU share's master is its compute copy): the planner then
    # cuts stages to the memory left, so the calls use what they are given. On one H200 start (2026-12-06, llm.py
    # --fused --master-dtype bf16 --state-dtype int8, 4 x 4096, each run its own process), 0.35 -> 0.2: the
    # Qwen3-32B shape 1,580 -> 1,649 tokens/s (GPU peak 120.5 -> 118.7 GiB; 29 -> 36 of 66 layers' state on the
    # GPU), GPT-OSS-20B 4,936 -> 6,764 (peak 118.3 -> 125.2; 0.25: 5,678), Qwen3-30B-A3B 3,174 -> 4,741 (peak
    # 124.9 -> 127.4 of 139 GiB).
    streamed_gpu_state_reserve: float = 0.2
    # ... but never fewer bytes than this (nor more than gpu_state_reserve's share). At 0.2 the MoE shapes above used
    # 15.6-16.8 GiB beyond their placed state, as much as 0.2 of an 80 GB card; there 0.35 (27.6 GiB) is what was
    # measured (H100, 2026-12-06: the 14 B shape peaked at 66.3 GiB, GPT-OSS-20B at 72.0). 27 GiB keeps that on an
    # 80 GB card and is under 0.2 of the H200's 139 GiB.
    streamed_reserve_floor: int = 27 * 2**30
    # Move saved activations to pinned host memory when one call's would take over this share of
    # the GPU: GPU memory then bounds one layer's activations, not the whole sequence's.
    offload_share: float = 0.25
    # True or False forces activation offloading on or off (GPU engines); None: decided by offload_share.
    offload_activations: Optional[bool] = None
    # Runs before recording a CUDA graph: lazy initialisation and cudnn's algorithm search happen there.
    graph_warmup: int = 2
    # Each input shape keeps its own graphs and activation memory: shapes past this run eagerly.
    max_recorded_graphs: int = 8
    # A graph's activations live in a private memory pool that eager work can never reuse. Stages
    # whose forward keeps more than this share of the GPU run eagerly: their kernels are long
    # enough that launch costs do not matter, and the memory is worth more to the other stages.
    max_graph_memory_share: float = 0.25
    # A replayed backward hands all the stage's gradients over at its end; eager autograd hands each
    # over as soon as it is accumulated, so its download overlaps the rest of the backward. Past this
    # many parameters that overlap is worth more than the launches a graph saves (3 B params on an
    # H200: the call took 0.85 s eager, 1.05 s replayed; ResNet-34's 21 M: 1.5 ms of downloads
    # against a step that launches cost most of).
    max_graph_params: int = 100_000_000
    # Replay a whole training call (every microbatch's forward, loss and backward) as one CUDA graph
    # where callpath.py allows it: the host then launches one graph a call instead of two graphs, the
    # loss's kernels and the autograd engine's work per microbatch. False: stage by stage, as before.
    whole_call_graphs: bool = True
    # Inside a whole call, run the microbatches as one batch where every layer treats each sample by itself
    # (fusion.py; BatchNorm keeps each microbatch's statistics): fewer, fuller kernels. The tutorial's loop
    # (ResNet-34, two microbatches of 64) took 10.45 against 14.41 ms a step (H100, one invocation, 2026-12-07,
    # bench/README). Calls on the stage-by-stage path of the same single GPU (a fresh engine's measuring
    # first call among them) run as one batch too (fused_call.py), so every path rounds alike and a run
    # resumed into a new engine stays bit-exact. Several GPUs keep their microbatches apart.
    fuse_microbatches: bool = True
    # torch.compile (inductor) the stage's layers inside the whole call's recording (CLI engine.compile):
    # fused elementwise kernels, paid for by compiling at the first recording of each call shape. Off: the
    # 20-epoch main job took 53.8 s without and 99.1 s with it (H200, one invocation at 5b07351, 2026-12-06:
    # the first epoch 10.8 -> 58.6 s, later ones 1.54-1.73 -> 1.30-1.55 s); its steady training rate was
    # 0.857x the compiled plain graphed loop's (0.874x uncompiled against uncompiled).
    compile_stages: bool = False
    # Of physical memory: frozen weights past this stay pageable. Pinned pages cannot be swapped or
    # reclaimed, and more would starve the rest of the process; pageable memory uploads through the
    # driver's staging buffer, about half as fast.
    pin_frozen_share: float = 0.5
    # Fraction of each flat tensor of a resident version that goes up as fp32 and is cast on the GPU
    # (refresh.py); the host casts the rest, into two host compute copies (2 x 2 bytes a bf16
    # parameter) that only a share below 1 allocates. Measured on the H200 at 990 M fp16 parameters
    # (bench/optimizer.py --gpu-shares): 96, 60, 58, 61 and 73 ms to stage a version at shares 0, 0.3,
    # 0.45, 0.6 and 1, overlapped with the next call; the 13 ms are not worth 4 bytes of host memory
    # a host-share parameter (21 GB for Llama-3.1-8B's host share on the H200 machine).
    refresh_gpu_share: float = 1.0
    # Elements per staging copy: bounds the GPU's fp32 scratch and lets uploads follow the host's pass.
    refresh_chunk: int = 1 << 25
    # Without a GPU the optimizer and the compute share the cores, and a second thread of OpenMP
    # work makes every small op pay a thread wake-up (3x slower on 2 cores): there the step runs
    # inline when submitted unless this is True. The staleness rules are the same either way.
    cpu_optimizer_thread: bool = False
    # Bytes per second one way between pinned host memory and a GPU. Where weights stream per stage, the
    # planner balances stages by their weights' upload and gradients' download as well as by the measured
    # compute (plan_stages): an MoE layer holds many times a dense layer's bytes for its FLOPs. Pinned H2D
    # and D2H both 55.4 GB/s on the H200 (bench/limits.py, 2 GiB copies, 2026-12-02). None: compute alone.
    transfer_rate: Optional[float] = 55.4e9

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type.startswith("Optional[") and value is None:
                continue
            if f.name == "transfer_rate":  # a rate, not a share
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                    raise ValueError(f"Tuning.{f.name} must be a positive number of bytes per second (or None), got {value!r}")
                continue
            if f.type in ("bool", "Optional[bool]"):
                if not isinstance(value, bool):
                    raise TypeError(f"Tuning.{f.name} must be True or False, got {value!r}")
            elif f.type == "int":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"Tuning.{f.name} must be a positive int, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"Tuning.{f.name} must be a share in [0, 1], got {value!r}")
