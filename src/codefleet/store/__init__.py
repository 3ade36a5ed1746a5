"""The rollout store: every finished rollout as one Parquet row, with an explicit, versioned schema.

Training writes it (`RolloutWriter`, `rollout_record`); the analytics (`codefleet analyze`), pandas,
DuckDB or any Parquet reader read it back (`read_rollouts`). It sits with the shared types, below
every package that writes or reads it. Layout and schema: docs/rollouts.md.
"""

from codefleet.store.parquet import RolloutWriter, read_rollouts, rollout_record
from codefleet.store.schema import SCHEMA, SCHEMA_VERSION

__all__ = ["SCHEMA", "SCHEMA_VERSION", "RolloutWriter", "read_rollouts", "rollout_record"]
