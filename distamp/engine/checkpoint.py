"""Rank-consistent, atomic checkpoints: sharded state through DCP, the rest from rank 0.

Layout of a checkpoint directory ``DIR``::

    DIR/latest.json             the manifest: which step directory is complete (written last)
    DIR/step_00000120/state/    model + optimizer, torch.distributed.checkpoint (every rank writes
                                its shards; replicated tensors are written once)
    DIR/step_00000120/trainer.pt  step counter, scaler, scheduler (rank 0; identical on all ranks)
    DIR/step_00000120/rng_<r>.pt  rank r's RNG streams (they differ between ranks)
    DIR/step_00000120/rank_<r>.pt rank r's own state when it has some (a comm hook's
                                error-feedback residuals)
    DIR/step_00000120/files.json  every other file's size and CRC-32 (:mod:`.integrity`)

A save goes to a hidden temporary directory first; every file is fsynced, the directory is
renamed into place, and only then is the manifest replaced (itself written to a temporary file,
fsynced and renamed). A crash at any point leaves the previous manifest pointing at a complete
checkpoint, so a loader never sees half a save. ``DIR`` must be one filesystem shared by all
ranks (as DCP requires).

Every rank raises, or none does: where a rank can fail alone (creating the directory, its
writes, reading back what it wrote; its files at load) the ranks agree on the outcome in one
small all-reduce (:func:`~distamp.cluster.agreement.agree_failures`), so a refusal reaches every
rank at once with the failing rank's reason instead of leaving its peers in a collective until
the timeout. A load verifies every file it will read (present, the size and CRC-32 recorded at
save time, the expected structure) and checks the state against the job before anything is
applied: a refused load changes nothing.

Model and optimizer go through ``get_state_dict``/``set_state_dict``, which give the same
parameter names whatever wrapper (none, DDP, FSDP1, FSDP2) holds the model: a checkpoint saved
under one strategy loads under another. The optimizer state is flattened (keyed by parameter
name), so pipeline stages that each hold part of the model keep their own hyper-parameters.

This module is the face of the three that do the work, and re-exports their names: saving and
the commit protocol (:mod:`.checkpoint_save`), reading, checking and applying
(:mod:`.checkpoint_load`), and the layout's names and errors both sides share
(:mod:`.checkpoint_layout`).
"""

from __future__ import annotations

from distamp.engine.checkpoint_layout import MANIFEST, CheckpointError, latest_checkpoint
from distamp.engine.checkpoint_load import (
    CheckpointRead,
    apply_checkpoint,
    load_checkpoint,
    read_checkpoint,
)
from distamp.engine.checkpoint_save import save_checkpoint
from distamp.engine.rng import capture_rng, restore_rng

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "CheckpointRead",
    "apply_checkpoint",
    "capture_rng",
    "latest_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "restore_rng",
    "save_checkpoint",
]
