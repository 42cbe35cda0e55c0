"""Training: the loop and its components.

loop.py         `train(TrainSettings(...), out=...)`, `Trainer`, `TrainState`: the loop a screen long
step.py         the loss (CE, MTP CE, sequence balance loss), the jitted optax step, the router-bias update
settings.py     `TrainSettings`, the model presets, `TrainerError` / `SettingError`
data.py         the corpus split, the token streams, the batches (a function of seed and step)
setup.py        the model, the optimizer and schedule, the jitted steps, the mesh, the memory check
evaluation.py   held-out evaluation, metrics.jsonl, loss.png
checkpoints.py  orbax checkpoints with checksums, exact restore, the HF-layout export
signals.py      SIGINT / SIGTERM: stop after the step, with a checkpoint
cli.py          `mla-train`
"""

from models.training.loop import RunResult, Trainer, TrainerError, TrainSettings, TrainState, train
from models.training.step import TrainConfig, init_train_state, loss_fn, make_train_step, router_bias_update

__all__ = [
    "RunResult",
    "TrainConfig",
    "TrainSettings",
    "TrainState",
    "Trainer",
    "TrainerError",
    "init_train_state",
    "loss_fn",
    "make_train_step",
    "router_bias_update",
    "train",
]
