"""Rewards from models, as environments: a reward model (RewardModelEnv), an LLM judge (JudgeEnv),
and rule and model rewards combined by weights (CombinedEnv).

Each model runs once, in a server actor of its own that the environment pool starts before its
workers (Environment.start_services): the workers send it their requests, which it gathers into
batches. Without a pool (`rlkit env check`) the environment loads its model in its own process.
"""
