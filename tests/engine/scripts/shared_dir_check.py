"""Run under `accelerate launch` with 2 processes: each rank checks the directory given for it, as a node
without a shared filesystem would see its own local disk at the same path; prints the outcome per rank."""

import json
import sys
from pathlib import Path

from accelerate import Accelerator

from rloo_engine.shared_output_dir import OutputDirNotShared, check_output_dir_shared

acc = Accelerator(cpu=True)
dirs = sys.argv[1:]
mine = dirs[acc.process_index % len(dirs)]
try:
    check_output_dir_shared(acc, mine)
    outcome = {"rank": acc.process_index, "error": None}
except OutputDirNotShared as err:
    outcome = {"rank": acc.process_index, "error": str(err)}
Path(mine, f"outcome-rank{acc.process_index}.json").write_text(json.dumps(outcome))
