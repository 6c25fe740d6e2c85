"""Run under `accelerate launch`: each rank runs `rloo-engine train` through `cli.main`, with an output_dir of its
own choosing (argv[1], directories joined by os.pathsep, taken by rank) as a node without a shared filesystem sees
its local disk; then writes into that directory what main returned, what it printed on stderr, whether the
process group outlived it, and how many DDP models (each holds the group) are still alive, uncollected: left to
interpreter teardown, either can make gloo abort the process at exit."""

import contextlib
import gc
import io
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rloo_engine.cli import main

rank = int(os.environ["RANK"])
dirs = sys.argv[1].split(os.pathsep)
mine = dirs[rank % len(dirs)]
stderr = io.StringIO()
with contextlib.redirect_stderr(stderr):
    code = main(["train", *sys.argv[2:], "--output_dir", mine])
Path(mine, f"outcome-rank{rank}.json").write_text(json.dumps({
    "rank": rank, "code": code, "stderr": stderr.getvalue(), "group_outlived_main": dist.is_initialized(),
    "ddp_models_alive": sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects()),
}))
