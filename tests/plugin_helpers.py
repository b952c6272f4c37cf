"""Hand-made inputs of the plugins' step planning (no engine needed)."""

from dataclasses import dataclass

import torch


@dataclass
class Metadata:  # the fields of vLLM's CPUAttentionMetadata that the plan reads
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    dynamic_causal: object = None
