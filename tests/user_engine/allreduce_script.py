"""A user's script for bfexp-run: three allreduce calls, then what each rank saw, one JSON line.

``--init ENGINE`` starts the engine by bf.init(engine=ENGINE) (the library API); without it bf.init()
starts what bfexp-run's --engine asked for.
"""

import json
import sys

import torch

import bfexp as bf

engine = bf.init(engine=sys.argv[2]) if sys.argv[1:2] == ["--init"] else bf.init()
total = bf.allreduce(torch.tensor([float(bf.rank() + 1)], dtype=torch.float64), op="sum")
for _ in range(2):
    bf.allreduce(torch.ones(3), op="avg")
print(json.dumps({"rank": bf.rank(), "size": bf.size(), "class": type(engine).__name__, "name": engine.name,
                  "total": float(total), "calls": engine.allreduce_calls}), flush=True)
