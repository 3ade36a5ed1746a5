"""Rollout analytics: the rollout store (store.py, schema.py), the Ray Data pipeline that
categorises and judges rollouts (pipeline.py, rules.py, judge.py), and the HTML report (report.py).

Training writes through `RolloutWriter`; `codefleet analyze RUN_DIR` reads the store back.
"""

from codefleet.analysis.schema import SCHEMA, SCHEMA_VERSION
from codefleet.analysis.store import RolloutWriter, read_rollouts, rollout_record

__all__ = ["SCHEMA", "SCHEMA_VERSION", "RolloutWriter", "read_rollouts", "rollout_record"]
