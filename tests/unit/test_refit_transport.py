"""refit.transport's lookup (rlkit/refit/transport.py): a built-in by its name, one of one's own by
"module:attribute"; anything else is refused in one config error line that names the key, the
choices and why, and a transport's rules come from its spec, before any worker starts."""

import pytest

from rlkit.config.schema import ConfigError
from rlkit.launch.config import load_config
from rlkit.refit.transport import TRANSPORTS, TransportSpec, transport_spec

OWN = TransportSpec("own", sending_half=object, receiving_half=object)  # halves never made here
NOT_A_SPEC = "a string"
CHOICES = ("refit.transport: must be one of ['cpu', 'cuda_ipc', 'nccl'] or a transport of your own as "
           "'module:attribute'")


def refused(name: str) -> str:
    with pytest.raises(ConfigError) as error:
        transport_spec(name)
    message = str(error.value)
    assert "\n" not in message, f"config errors are one line: {message!r}"
    return message


def test_an_unknown_name_is_refused_in_one_line_naming_the_key_and_the_choices():
    assert refused("rdma").startswith(f"{CHOICES} (got: 'rdma'); pick one of those")


@pytest.mark.parametrize("name, why", [
    ("no_such_module:SPEC", "No module named 'no_such_module'"),
    ("test_refit_transport:NOT_A_SPEC", "module 'test_refit_transport' defines no TransportSpec 'NOT_A_SPEC'"),
    ("test_refit_transport:MISSING", "module 'test_refit_transport' defines no TransportSpec 'MISSING'"),
    ("test_refit_transport:", ""),
])
def test_a_name_that_yields_no_spec_is_refused_saying_why(name, why):
    message = refused(name)
    assert message.startswith(f"{CHOICES} (got: {name!r})") and message.endswith(why)


def test_built_ins_by_name_and_ones_own_by_module_and_attribute():
    assert transport_spec("nccl") is TRANSPORTS["nccl"] and transport_spec("test_refit_transport:OWN") is OWN


def test_refit_delta_over_a_transport_without_deltas_is_refused():
    with pytest.raises(ConfigError, match=r"^refit.delta: refit.transport=test_refit_transport:OWN does not send "
                                          r"deltas; set refit.delta=false$"):
        load_config("grpo_tiny_cpu", ["refit.transport=test_refit_transport:OWN", "refit.delta=true"])
    cfg, _ = load_config("grpo_tiny_cpu", ["refit.transport=test_refit_transport:OWN"])
    assert cfg.refit.transport == "test_refit_transport:OWN"
