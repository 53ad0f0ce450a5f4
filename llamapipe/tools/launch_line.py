"""How `llamapipe plan` prints the top row's launch: torchrun on one node, the repository's own
scripts/launch_multi_node.sh (c10d rendezvous, a node rank per node) when the job spans nodes, and the run-length
and learning-rate flags the planner cannot choose, without which pretrain_llama.py trains its defaults."""
from __future__ import annotations

MAX_GPUS_PER_NODE = 8
MULTI_NODE_SCRIPT = "scripts/launch_multi_node.sh"
SLURM_SCRIPT = "scripts/launch_slurm.sbatch"
FIRST_NODE, NODE_RANK = "FIRST_NODE", "K"      # placeholders the multi-node line's note explains
RUN_NOTE = ("the top row's command trains pretrain_llama.py's defaults, 10 iterations at --lr 3e-4 (linear decay to "
            "--min-lr 0, no warmup): add your run length and learning rate, --train-iters N (or --train-samples N), "
            "--lr, --min-lr, --lr-decay-style, --lr-warmup-iters (or --lr-warmup-samples)")


def nodes_of(gpus: int) -> tuple[int, int]:
    """(nodes, GPUs per node) for `gpus`: one node up to 8, else the most GPUs per node (<= 8) that divide it."""
    per_node = max(d for d in range(1, MAX_GPUS_PER_NODE + 1) if gpus % d == 0)
    return gpus // per_node, per_node


def launcher(gpus: int) -> str:
    """The words before the trainer's flags: torchrun for one node, else the multi-node script run on each node."""
    nodes, per_node = nodes_of(gpus)
    if nodes == 1:
        return f"torchrun --nproc-per-node {gpus} pretrain_llama.py"
    return (f"MASTER_ADDR={FIRST_NODE} NNODES={nodes} NODE_RANK={NODE_RANK} GPUS_PER_NODE={per_node} "
            f"bash {MULTI_NODE_SCRIPT}")


def top_row(gpus: int, command: str) -> str:
    """The 'Top row:' lines for `command` (launcher(gpus) and the flags), with where to run it if it spans nodes."""
    nodes, per_node = nodes_of(gpus)
    if nodes == 1:
        return f"Top row:\n  {command}"
    slurm = (f"sbatch --nodes {nodes}" if per_node == MAX_GPUS_PER_NODE else
             f"GPUS_PER_NODE={per_node} sbatch --nodes {nodes} --gpus-per-node {per_node}")
    return (f"The job spans {nodes} nodes of {per_node} GPUs: run the top row on every node, {FIRST_NODE} the "
            f"first node's address and {NODE_RANK} the node's rank, 0 to {nodes - 1} (docs/cluster.md); under SLURM "
            f"give the same flags to `{slurm} {SLURM_SCRIPT}` instead.\nTop row:\n  {command}")
