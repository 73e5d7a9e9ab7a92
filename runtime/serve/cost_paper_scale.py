"""The paper-scale cost profile: a 0.2B HSTU (d=1024, 28 layers, bf16 K/V, 4k-token prefixes) on one H200.

It is a model until the accelerator machine measures it (``"source": "model"``): the step coefficients of
runtime/serve/cost_profile.py derived from FLOPs at a named efficiency and from bytes at the memory's
bandwidth, added (no overlap of compute and memory: the roofline's upper side). Its residuals are zero: a
model has no measured spread, so a simulator drawing from it gets the deterministic cost. The hardware
figures and where they come from:

==========================  ==========================  ==================================================
quantity                    value                       source
==========================  ==========================  ==================================================
bf16 dense tensor peak      989 TFLOP/s                 NVIDIA H200 datasheet (1,979 with 2:4 sparsity)
efficiency                  0.4 of the peak (named)     a parameter, not a measurement
HBM3e                       141 GB at 4.8 TB/s          NVIDIA H200 datasheet
usable device memory        0.9 of it                   vLLM's default gpu_memory_utilization
host-device link            55 GB/s per direction       PCIe Gen5 x16 (64 GB/s raw per direction; the
                                                        datasheet's 128 GB/s is both ways), pinned copies
                                                        reach about 55
NVLink-C2C                  not used                    450 GB/s per direction only on GH200 (Grace
                                                        Hopper); an H200 SXM or NVL sits behind PCIe
kernel launches             20 us per layer per step    a parameter (about five kernels at ~4 us)
host work per user          20 us per user per step     a parameter (jagged inputs built on the host)
==========================  ==========================  ==================================================

The arithmetic: K/V bytes per token ``2·d·L·2`` (+8 for the timestamp the engine keeps), so one 4,096-token
prefix is 0.47 GB; dense FLOPs ``2·P·n`` with P = 0.2e9 matmul parameters; attention ``4·d·L`` FLOPs per
query-key pair (QKᵀ and AV), so a 4k prefill (n(n+1)/2 pairs) is 2.6 TFLOP in all; each step reads the weights
once (``2·P`` bytes) and its users' cached K/V once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from grstack.runtime.serve.cost_profile import STEP_FEATURES, CostModel, CostProfile
from grstack.runtime.serve.step_log import STEP_KINDS, attention_pairs


@dataclass(frozen=True)
class PaperScale:
    d_model: int = 1024
    layers: int = 28
    dense_params: float = 0.2e9
    dtype_bytes: int = 2
    prefix_tokens: int = 4096
    peak_flops: float = 989e12
    efficiency: float = 0.4
    hbm_bytes_per_s: float = 4.8e12
    device_memory_bytes: float = 141e9
    memory_utilization: float = 0.9
    host_device_bytes_per_s: float = 55e9
    launch_s_per_layer: float = 20e-6
    host_s_per_user: float = 20e-6

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.d_model * self.layers * self.dtype_bytes + 8

    def prefix_bytes(self, tokens: int | None = None) -> int:
        return self.kv_bytes_per_token * (self.prefix_tokens if tokens is None else tokens)

    def prefill_flops(self, tokens: int | None = None) -> float:
        n = self.prefix_tokens if tokens is None else tokens
        return 2 * self.dense_params * n + 4 * self.d_model * self.layers * attention_pairs([n], [0])

    def promotion_s(self, tokens: int | None = None) -> float:
        """One prefix from host DRAM to the device."""
        return self.prefix_bytes(tokens) / self.host_device_bytes_per_s

    def resident_prefixes(self, tokens: int | None = None) -> int:
        """Prefixes the usable device memory holds beside the weights."""
        room = self.device_memory_bytes * self.memory_utilization - self.dense_params * self.dtype_bytes
        return int(room // self.prefix_bytes(tokens))

    def step_model(self) -> CostModel:
        flops = self.peak_flops * self.efficiency
        coef = {"step": self.dense_params * self.dtype_bytes / self.hbm_bytes_per_s
                + self.layers * self.launch_s_per_layer,
                "batch": self.host_s_per_user,
                "tokens": 2 * self.dense_params / flops + self.kv_bytes_per_token / self.hbm_bytes_per_s,
                "context": self.kv_bytes_per_token / self.hbm_bytes_per_s,
                "pairs": 4 * self.d_model * self.layers / flops,
                "cold": 0.0}  # K/V is read from HBM whether or not it was just computed: the bytes are in context
        return CostModel(STEP_FEATURES, tuple(coef[f] for f in STEP_FEATURES))


def paper_scale_profile(spec: PaperScale | None = None) -> CostProfile:
    """The paper-scale profile, in the format of a calibrated one; the host's request CPU and hops are not
    part of it (:func:`with_host_costs` takes them from a calibrated profile)."""
    s = spec or PaperScale()
    step = s.step_model()
    model = {"name": "HSTU 0.2B", **asdict(s), "kv_dtype": "bf16" if s.dtype_bytes == 2 else f"{s.dtype_bytes}B",
             "kv_bytes_per_token": s.kv_bytes_per_token, "prefix_bytes": s.prefix_bytes(),
             "prefill_flops": s.prefill_flops(), "prefill_s": step.predict(
                 {"batch": 1, "tokens": s.prefix_tokens, "context": 0, "pairs": attention_pairs([s.prefix_tokens], [0])}),
             "promotion_s": s.promotion_s(), "resident_prefixes": s.resident_prefixes()}
    return CostProfile(source="model", host={"device": "NVIDIA H200 (data sheet; not measured)"}, model=model,
                       steps=dict.fromkeys(STEP_KINDS, step),
                       transfers={"host_to_device": s.host_device_bytes_per_s,
                                  "device_to_host": s.host_device_bytes_per_s},
                       notes="a model from FLOPs at the named efficiency and bytes at HBM bandwidth "
                             "(runtime/serve/cost_paper_scale.py), until a device measures it")


def with_host_costs(profile: CostProfile, measured: CostProfile) -> CostProfile:
    """``profile``'s steps with ``measured``'s request CPU and hops (host work an accelerator does not change)."""
    return CostProfile(source=profile.source, host={**profile.host, "host_costs_from": measured.host},
                       model=profile.model, steps=profile.steps, requests=dict(measured.requests),
                       hops=dict(measured.hops), transfers=profile.transfers, notes=profile.notes)
