"""The dry run (issue 41): a job's real setup for every distinct rank, on fake process groups and meta tensors.

`llamapipe dry-run --world-size N <pretrain_llama.py flags>` (or `pretrain_llama.py --dry-run --world-size N`)
checks a job of N ranks in one process, without its machines: the argument checks, each role's parallel
state and groups (`world`), model shard, one step of the executor (`step`, `messages`), optimizer and ZeRO
shards and checkpoint files (`rank`, `checkpoint`), and a memory report against the device (`report`);
`main` runs them. docs/dry_run.md says how to read its output.
"""
