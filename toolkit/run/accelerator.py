"""The Accelerator every run uses: Accelerate's, less one division a step.

`Accelerator.backward` divides the loss by the gradient-accumulation steps before backward, also when they are 1: a
division in the forward and its gradient's in the backward, two kernel launches a step that change no value (x / 1.0
is exact). Without accumulation (and without a grad scaler, DeepSpeed, Megatron or a LOMO optimizer, where
Accelerate's backward does more) this one calls backward directly; otherwise Accelerate's does it all."""

from __future__ import annotations

from accelerate import Accelerator
from accelerate.utils import DistributedType


class ToolkitAccelerator(Accelerator):
    def backward(self, loss, **kwargs):
        plain = (self.gradient_accumulation_steps == 1 and self.scaler is None and "learning_rate" not in kwargs
                 and self.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM))
        if plain:
            loss.backward(**kwargs)
        else:
            super().backward(loss, **kwargs)
