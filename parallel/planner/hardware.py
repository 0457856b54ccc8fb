"""The hardware numbers the planner uses, in one table, and the efficiencies it applies to them.

Peaks are dense (no 2:4 sparsity) numbers from NVIDIA's data sheets for the SXM parts; memory is what
torch.cuda.mem_get_info reports as total on an idle device. Links are per GPU and per direction:
NVLink inside a node, the node's InfiniBand/RoCE NIC (one 400 Gb/s ConnectX-7 per GPU on DGX/HGX
H100, H200 and B200) across nodes. docs/cluster.md ("Step time") repeats this table and says where
each efficiency comes from; tests/unit/parallel/test_plan_time.py holds the two copies equal.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float          # what torch.cuda.mem_get_info reports as total on an idle device
    bf16_tflops: float = 0.0   # dense tensor-core peak
    fp8_tflops: float = 0.0
    hbm_tbps: float = 0.0      # HBM bandwidth, TB/s
    nvlink_gbps: float = 0.0   # NVLink, GB/s per GPU per direction
    nic_gbit: float = 0.0      # inter-node NIC, Gb/s per GPU

    @property
    def nic_bytes(self) -> float:
        return self.nic_gbit * 1e9 / 8

    @property
    def nvlink_bytes(self) -> float:
        return self.nvlink_gbps * 1e9


GPUS = {
    "h100": GpuSpec("h100", 79.6, bf16_tflops=989, fp8_tflops=1979, hbm_tbps=3.35, nvlink_gbps=450, nic_gbit=400),
    "h200": GpuSpec("h200", 139.8, bf16_tflops=989, fp8_tflops=1979, hbm_tbps=4.8, nvlink_gbps=450, nic_gbit=400),
    "b200": GpuSpec("b200", 179.1, bf16_tflops=2250, fp8_tflops=4500, hbm_tbps=8.0, nvlink_gbps=900, nic_gbit=400),
}

# Efficiencies (fractions of the peaks above); docs/cluster.md justifies each.
TRAIN_MFU = 0.35            # bf16 model-FLOPs utilisation of Megatron-Core MoE training at scale
FP8_TRAIN_SPEEDUP = 1.3     # end-to-end step speed-up of TE FP8 over bf16 (GEMMs 2x, the rest 1x)
DECODE_HBM_EFF = 0.7        # achieved fraction of HBM bandwidth in decode (weights + KV reads)
PREFILL_MFU = 0.4           # prefill is compute-bound
LINK_EFF = 0.8              # achieved fraction of a NIC / NVLink in large NCCL transfers
PCIE_BYTES = 25e9           # host <-> device per GPU (PCIe Gen5 x16, achieved), optimizer offload and swap
CPU_ADAM_PARAMS_PER_S = 2e9  # CPU Adam updates per second per node (the offloaded optimizer step)
BUCKET_OVERHEAD_S = 0.005   # one weight-sync bucket: HTTP call and CUDA sync (order of magnitude)
PER_TENSOR_S = 100e-6       # one tensor loaded by one engine rank: a Python weight_loader call (order of magnitude)
# DeepEP low-latency dispatch + combine per MoE layer in decode (128 tokens/GPU, its published table),
# by expert-parallel size; EP within one NVLink domain is the ep = 8 row.
EP_A2A_S = {8: 191e-6, 16: 313e-6, 32: 428e-6, 64: 487e-6, 128: 561e-6, 256: 554e-6}


def ep_all_to_all_seconds(ep: int) -> float:
    """Dispatch + combine of one MoE layer for an engine of expert-parallel size `ep` (0 for ep = 1)."""
    if ep <= 1:
        return 0.0
    sizes = sorted(EP_A2A_S)
    return EP_A2A_S[min((s for s in sizes if s >= ep), default=sizes[-1])]


def gpu_spec(name: str) -> GpuSpec:
    """The named GPU; unknown names raise ValueError naming the known ones."""
    if name not in GPUS:
        raise ValueError(f"--gpu {name!r} is unknown; use one of {', '.join(GPUS)}")
    return GPUS[name]
