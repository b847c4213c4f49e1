"""verl 0.9.1's sync replay buffer with a shorter poll (trainer.v1.sampler.custom_sampler), loaded
by verl from this file's path inside its own install; it imports only verl.

Why: verl's sync trainer times its `gen` phase around ReplayBuffer.sample, which checks for
finished rollouts and sleeps a fixed 2 s (ReplayBuffer.__init__'s poll_interval, not a config key)
between checks, so `timing_s/gen` is the generation time rounded up to the next poll. This class
changes only that interval, read from trainer.v1.sampler.sampler_kwargs.poll_interval_s; the
trainer hands a custom sampler the same arguments as its own minus the DAPO ones, unused here."""

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer


class PollingReplayBuffer(ReplayBuffer):
    def __init__(self, *args, sampler_kwargs, **kwargs):
        super().__init__(*args, sampler_kwargs=sampler_kwargs, poll_interval=float(sampler_kwargs["poll_interval_s"]),
                         **kwargs)
