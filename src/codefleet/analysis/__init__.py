"""Rollout analytics: the Ray Data pipeline that categorises and judges rollouts (pipeline.py,
rules.py, judge.py) and the HTML report (report.py).

It reads the rollout store (`codefleet.store`) that training writes: `codefleet analyze RUN_DIR`.
"""
