#!/usr/bin/env bash
# Start a Ray cluster on the nodes of a Slurm allocation, then submit an rlkit run to it.
#   sbatch --nodes=2 --gpus-per-node=8 scripts/slurm_launch.sh --config-name my_recipe key=value ...
# Every node needs the same environment (e.g. the image built from docker/Dockerfile).
#SBATCH --job-name=rlkit
#SBATCH --exclusive
#SBATCH --ntasks-per-node=1
set -euo pipefail
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head=${nodes[0]}
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | awk '{print $1}')
port=${RAY_PORT:-6379}
dashboard_port=${RAY_DASHBOARD_PORT:-8265}

srun --nodes=1 --ntasks=1 -w "$head" \
  ray start --head --block --node-ip-address="$head_ip" --port="$port" \
  --dashboard-host="$head_ip" --dashboard-port="$dashboard_port" &
until ray status --address="$head_ip:$port" >/dev/null 2>&1; do sleep 2; done
for node in "${nodes[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" ray start --block --address="$head_ip:$port" &
done

# the run joins this cluster through RAY_ADDRESS, which ray job submit sets for the driver
ray job submit --address="http://$head_ip:$dashboard_port" -- rlkit train "$@"
