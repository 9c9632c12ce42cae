"""The environment a node agent gives every process of a job: the contract between
``services/nodeagent`` (which sets it) and ``gpuherd.train`` (which reads it).

The torch.distributed names follow torchrun, so a script written for torchrun
runs under gpuherd unchanged.
"""

from __future__ import annotations

MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"  # the node's index in the gang (torchrun's name)
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
JOB_ID = "GPUHERD_JOB_ID"
ATTEMPT = "GPUHERD_ATTEMPT"
NODE = "GPUHERD_NODE"
AGENT_ADDR = "GPUHERD_AGENT_ADDR"  # the agent's control socket (see services/nodeagent/control.py)
VIRTUAL_GPUS = "GPUHERD_VIRTUAL_GPUS"  # cpu executor: the declared GPU indices this process stands for
TASK_DIR = "GPUHERD_TASK_DIR"  # the attempt's folder on the node: the agent leaves requests there

RESERVED = frozenset(
    {
        MASTER_ADDR,
        MASTER_PORT,
        RANK,
        WORLD_SIZE,
        LOCAL_RANK,
        LOCAL_WORLD_SIZE,
        GROUP_RANK,
        CUDA_VISIBLE_DEVICES,
        JOB_ID,
        ATTEMPT,
        NODE,
        AGENT_ADDR,
        VIRTUAL_GPUS,
        TASK_DIR,
    }
)

# In TASK_DIR: the agent writes a profile request (``{"request": id, "steps": n}``), the leader
# rank claims it and writes its profile (``StepProfile.to_dict()``) there before telling the agent.
PROFILE_REQUEST_FILE = "profile-request.json"


def profile_result_file(rank: int) -> str:
    return f"profile-rank{rank}.json"
