"""One stage's part of the GLM-MoE model: its layers (and the embedding on the first stage, the final norm and the
output layer on the last), run inside the rank's :class:`~reference_trainer.provision.Provisioner`, with an
identity at the input that reports the end of the chunk's backward. A pipeline stage's module (``pipeline.py``)
and, at PP = 1, the whole model's.
"""

from __future__ import annotations

import torch
from torch import nn

from bagualu2.exec import on_backward

from .instrumented import instrument_reference
from .model import GLMMoEModel
from .provision import Provisioner
from .routing import bias_towards, routing_stats


class ChunkModule(nn.Module):
    """One pipeline stage's part of the model (shares the parameters of ``model``)."""

    def __init__(self, model: GLMMoEModel, *, stage_index: int, num_stages: int, chunk: int, layers: range,
                 provisioner: Provisioner):
        super().__init__()
        self.chunk, self.stage_index, self.layer_range = chunk, stage_index, layers
        self.embedding = model.embedding if stage_index == 0 else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        last = stage_index == num_stages - 1
        self.final_norm = model.final_norm if last else None
        self.output = model.output if last else None
        self.tied = last and model.output is None
        if self.tied and stage_index != 0:
            raise ValueError("tie_embeddings needs the embedding and the output layer on one stage (pp=1)")
        self.model = [model]  # not a submodule: its state is this chunk's parts only
        self.provisioner = provisioner
        self.next_microbatch = 0
        self.spikes: dict[int, tuple[int, int]] = {}  # micro-batch -> (target EP rank, this rank's picks)
        self.moes = [model.layers[i].mlp for i in layers if model.layers[i].is_moe]
        self.instrumented = instrument_reference(self)  # its layers' op modules (paths layers.<global index>)

    def _layers(self, x: torch.Tensor) -> torch.Tensor:
        return self.model[0].forward_layers(x, self.layer_range)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mb = self.next_microbatch
        self.next_microbatch += 1
        if self.embedding is not None:
            x = self.embedding(x)
        done = self.provisioner.backward_callback(self.chunk, mb)
        x = on_backward(x, done)
        spike = self.spikes.get(mb)
        learned = [moe.expert_bias for moe in self.moes]
        try:
            if spike is not None:  # a new bias tensor: replays of the router read the spiked one
                for moe, bias in zip(self.moes, learned):
                    moe.expert_bias = bias.clone()
                    bias_towards(moe, *spike)
            x = self.provisioner.run(self.chunk, mb, self._layers, x, self.moes)
        finally:
            for moe, bias in zip(self.moes, learned):
                moe.expert_bias = bias
        stats = [routing_stats(moe) for moe in self.moes]
        self.provisioner.note_routing([s.last for s in stats])
        if spike is not None:  # forced routing must not teach the balancing biases
            for s in stats:
                s.load = s.load - s.last
        if self.final_norm is not None:
            x = self.final_norm(x)
            x = x @ self.model[0].embedding.weight.t() if self.tied else self.output(x)
        return x
