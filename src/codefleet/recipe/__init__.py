"""The training application: `codefleet train` and `codefleet eval`.

A run goes tasks -> expert demonstrations -> SFT -> asynchronous RL -> held-out evaluations, in
one run directory that a stopped run resumes from. The pieces: its configuration (`config`, checked by
`config_check`), the run directory (`run_dir`), the phases (`train`: set-up, demonstrations, SFT, evaluations;
`train_rl`: RL on the Ray layer of `codefleet.fleet`), the scripted expert's demonstrations
(`demos`), fresh names for demonstrations (`augment`), which task RL attempts next (`curriculum`),
the evaluations (`evaluate`) and the command line (`cli`).
"""
