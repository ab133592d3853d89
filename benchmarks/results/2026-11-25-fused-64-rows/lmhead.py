import os, sys, time
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
sys.path.insert(0, os.getcwd())
from sglang.srt.server_args import ServerArgs
from sglang.srt.model_loader.model_info import load_model_info
from sglang.srt.managers.process_utils import load_tokenizer_for
from sglang.srt.managers.scheduler.loop import Scheduler
from sglang.srt.server_args import PortArgs
torch.set_num_threads(2)
sa = ServerArgs(model_path="HuggingFaceTB/SmolLM2-135M-Instruct"); sa.validate()
sched = Scheduler(sa, PortArgs.init_new(), load_model_info(sa), load_tokenizer_for(sa))
model = sched.runner.model
lm = model.lm_head
m = lm.quant_method if hasattr(lm, "quant_method") else None
from sglang.srt.layers.linear import linear_methods
meth = [x for x in linear_methods(model)][-1]
print(type(meth).__name__, meth.describe())
w = lm.weight
targets = [(meth, w)]
layer = model.model.layers[0].mlp.gate_up_proj
lm_meth = [x for x in linear_methods(layer)][0]
print(lm_meth.describe())
targets.append((lm_meth, layer.weight))
for (meth, w) in targets:
  for M in (2, 4, 8, 12, 16, 32, 64):
      x = torch.randn(M, w.shape[1])
      for name, fn in (("gguf int8", lambda: meth.quant_weight.linear(x, None, True)), ("bf16", lambda: meth.large.apply(w, x, None))):
          for _ in range(5): fn()
          ts = []
          for _ in range(30):
              t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
          ts.sort(); print(M, name, f"{ts[len(ts)//2]*1e3:.2f} ms")
