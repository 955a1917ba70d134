"""A GGUF model run across zmq-rpc workers: a pipeline of contiguous layer ranges.

Any architecture :mod:`~zmq_rpc.client.architectures` describes (llama, qwen2, qwen3, gemma3,
phi3): ``LlamaModel`` keeps the llama family's name and loads them all, its graphs switching on
the architecture's options (``general.architecture`` picks them).

``LlamaModel.load(path, clients)`` splits the layers into stages (one per
:class:`~zmq_rpc.client.Client`, balanced by resident weight bytes), uploads the weights in their
compact GGUF form and lays them out on the workers, registers per stage one forward graph per mode,
and then prefills, decodes and generates with the KV cache on the workers and the activations
handed from worker to worker. A worker lost on the way is recovered from (``recover=True``, the
default): its layers re-placed on the others, generation goes on.

Modules, one job each (all run on the caller's thread; futures settle on the clients' I/O
threads):

- :mod:`.plan`: which layers and GGUF tensors each stage holds; the ``Stage`` record;
- :mod:`.weights`: the weights mode (``f32`` or ``quantized``), the one seam a new mode plugs into;
- :mod:`.load`: GGUF staging, upload and the resident layout on the workers;
- :mod:`.graph`: the stages' forward graphs;
- :mod:`.runtime`: the KV cache and the step scheduler (chunks through the chained stages);
- :mod:`.decode`: generation, with greedy tokens fed back worker to worker;
- :mod:`.sampling`: temperature, top-k and top-p sampling;
- :mod:`.recovery`: a lost worker's stages re-placed onto a spare or a survivor, the sequence
  replayed into the caches, and generation going on (greedy output unchanged);
- :mod:`.model`: :class:`LlamaModel`, which composes them and owns their lifecycle.
"""

from .load import LoadStats, file_runs
from .model import LlamaModel
from .plan import plan_stages
from .runtime import StepStat
from .sampling import sample_token
from .weights import WeightsMode

__all__ = ["LlamaModel", "LoadStats", "StepStat", "WeightsMode", "file_runs", "plan_stages",
           "sample_token"]
