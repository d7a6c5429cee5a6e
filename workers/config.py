"""Engine configuration: one frozen dataclass per engine instance.

Pure Python (no torch), so the cluster layer can build, validate and ship configs without
loading a model. Per-instance variants are made with ``dataclasses.replace``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ROLES = ("prefill", "decode", "mixed")
PREEMPTION_MODES = ("swap", "recompute")
DEVICES = ("cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")

# Used when neither num_device_blocks nor kv_cache_memory_bytes is given: enough for a few
# long chains of the tiny model on a laptop, small enough not to surprise anyone.
DEFAULT_KV_CACHE_MEMORY_BYTES = 256 * 2**20


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny-reasoner"  # "tiny-reasoner" or a Hugging Face-format model directory
    role: str = "mixed"  # prefill | decode | mixed
    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "auto"  # auto = the checkpoint's dtype (float32 on CPU when it is half precision)
    block_size: int = 16
    # KV capacity: give blocks directly, or a byte budget the engine divides by the block size.
    num_device_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    # First swap tier (host block pool). 0 and no external swap space (LLMEngine(swap_space=...),
    # a live object, so not part of this plain config) means preemption always recomputes.
    num_host_blocks: int = 0
    max_num_seqs: int = 64  # running sequences (branches), the batch size limit
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill splits prompts)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    preemption_mode: str = "swap"  # swap | recompute (swap: host blocks, then the engine's external swap space, then recompute)
    seed: int | None = None  # makes the seeds given to unseeded requests reproducible
    # Return the final hidden state (after the final norm) of a sampled position, for the router's
    # length probe: None never; 0 at each branch's first token (the prefill); k > 0 also every k
    # output tokens. It is computed anyway for the logits, so this costs one row copy.
    hidden_state_interval: int | None = None
    # CUDA: run every step eagerly instead of replaying decode steps as captured CUDA graphs
    # (one graph per batch-size bucket up to max_num_seqs, captured at start-up; cuda_graphs.py).
    # vLLM's name for the same switch. No effect on CPU.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_device_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give num_device_blocks or kv_cache_memory_bytes, not both")
        if self.num_device_blocks is not None and self.num_device_blocks < 1:
            raise ValueError(f"num_device_blocks must be >= 1, got {self.num_device_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.hidden_state_interval is not None and self.hidden_state_interval < 0:
            raise ValueError(f"hidden_state_interval must be None or >= 0, got {self.hidden_state_interval}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown engine config field(s): {sorted(unknown)}")
        return cls(**d)
