"""Run under torchrun, 2 processes: the server-mode weight source over FSDP2 shards (`vllm_server._ItemsSource`).

Rank 0 reads a pass as a sender does and stops part way, as a failed send does; `finish_pass` on both ranks must
then complete every gather (a rank left in one would hang). A second, whole pass gives rank 0 the full tensors.
Writes `<out>/rank<r>.json`."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from rloo_engine.generation.vllm_server import _ItemsSource

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
model = LlamaForCausalLM(config)
whole = {k: v.clone() for k, v in model.state_dict().items()}
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)

source = _ItemsSource()
source.begin(list(model.state_dict().items()))
report = {"sharded": source.sharded, "same_as": source.same_as(), "names": [n for n, _ in source.items]}
if rank == 0:
    partial = iter(source)
    for _ in range(3):
        next(partial)  # then the send fails
report["gathered_before_finish"] = source.gathered
source.finish_pass()
source.begin(list(model.state_dict().items()))
if rank == 0:
    report["max_diff"] = max((tensor - whole[name]).abs().max().item() for name, tensor in source)
else:
    source.finish_pass()
dist.barrier()
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(report))
dist.destroy_process_group()
