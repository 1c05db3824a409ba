import re

import pytest

from megatron_lev.config import RunConfig, load_config, parse_override
from megatron_lev.errors import ConfigError
from tests.conftest import ROOT


def write(tmp_path, text, name="run.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_validate():
    cfg = RunConfig().validate()
    assert cfg.model.embedding == "lev"
    assert cfg.model.lev.k == 3 and cfg.model.lev.d_seed == 128 and cfg.model.lev.kappa == 16


def test_yaml_and_dotted_overrides(tmp_path):
    base = write(tmp_path, "model:\n  hidden_size: 64\n  lev:\n    rank: 8\ntrain:\n  lr: 1.0e-3\n")
    cfg = load_config(
        [base],
        ["model.embedding=tied", "train.lr=3e-4", "model.lev.heads=2", "data.data_path=[0.5, b, 0.5, d]"],
    )
    assert cfg.model.hidden_size == 64 and cfg.model.lev.rank == 8
    assert cfg.model.embedding == "tied" and cfg.model.lev.heads == 2
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.data.data_path == ["0.5", "b", "0.5", "d"]


def test_later_files_override_and_include(tmp_path):
    write(tmp_path, "model:\n  num_layers: 3\n  hidden_size: 96\n  num_attention_heads: 3\n", "base.yaml")
    child = write(tmp_path, "include: base.yaml\nmodel:\n  num_layers: 5\n", "child.yaml")
    cfg = load_config([child])
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (5, 96)


def test_unknown_key_is_an_error_with_suggestion(tmp_path):
    with pytest.raises(
        ConfigError, match=r"unknown config key 'model.embeding'.*did you mean 'model.embedding'"
    ):
        load_config([], ["model.embeding=lev"])
    bad = write(tmp_path, "trian:\n  lr: 1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'trian'; did you mean 'train'"):
        load_config([bad])


def test_type_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"model.num_layers must be an integer, got 'many'"):
        load_config([], ["model.num_layers=many"])
    with pytest.raises(ConfigError, match=r"model.activation_checkpointing must be true or false"):
        load_config([], ["model.activation_checkpointing=3"])


def test_choice_errors_list_allowed_values(capsys):
    with pytest.raises(ConfigError, match=r"train.precision='bf61' is not one of .*did you mean 'bf16'"):
        load_config([], ["train.precision=bf61"])
    # the embedding variants are listed by the model's registry, which the config command consults
    from megatron_lev.cli import main

    assert main(["config", "model.embedding=levv"]) == 2
    assert re.search(
        r"model.embedding='levv' is not one of tied, .*lev.*did you mean 'lev'", capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["model.num_attention_heads=3", "model.hidden_size=96", "parallel.tensor_model_parallel_size=2"],
            r"num_attention_heads=3 is not divisible by parallel.tensor_model_parallel_size=2",
        ),
        (
            ["model.lev.heads=6", "model.num_attention_heads=4", "parallel.tensor_model_parallel_size=4"],
            r"model.lev.heads=6 is not divisible by parallel.tensor_model_parallel_size=4",
        ),
        (
            ["parallel.pipeline_model_parallel_size=2", "parallel.zero_stage=2"],
            r"zero_stage=2 cannot be combined with pipeline parallelism.*Use parallel.zero_stage=1",
        ),
        (
            ["parallel.pipeline_model_parallel_size=2", "parallel.zero_stage=0", "train.precision=bf16"],
            r"bf16 with pipeline parallelism needs parallel.zero_stage=1",
        ),
        (["parallel.pipeline_model_parallel_size=3"], r"exceeds model.num_layers=2"),
        (["train.train_iters=null"], r"set one of train.train_iters, train.train_tokens"),
    ],
)
def test_refused_combinations(overrides, message):
    from megatron_lev.plan import validate_config

    with pytest.raises(ConfigError, match=message):  # the generic rules and the variant's (LEV's heads)
        validate_config(load_config([], overrides, validate=False))


def test_world_size_layout_checks():
    """The layout of a world size is the plan's rule, with `parallel.layout`'s arithmetic (one owner)."""
    from megatron_lev.parallel.layout import ParallelLayoutError
    from megatron_lev.plan import validate_config
    from megatron_lev.plan.ds_config import data_parallel_size

    def checked(overrides, world):
        return validate_config(load_config([], overrides, validate=False), world)

    with pytest.raises(
        ConfigError, match=r"world size 6 is not divisible by tensor x pipeline parallel size = 2 x 2"
    ):
        checked(["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"], 6)
    with pytest.raises(
        ConfigError, match=r"global_batch_size=6 is not divisible by train.micro_batch_size x DP = 4 x 1"
    ):
        checked(["train.global_batch_size=6"], 1)
    with pytest.raises(ParallelLayoutError, match=r"world size 0 is out of range"):
        checked([], 0)
    cfg = checked(["parallel.tensor_model_parallel_size=2", "train.global_batch_size=16"], 8)
    assert data_parallel_size(cfg, 8) == 4
    assert load_config([], ["parallel.tensor_model_parallel_size=2"]).parallel.tensor_model_parallel_size == 2


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        parse_override("model.embedding")
    with pytest.raises(ConfigError, match="the key must be dotted"):
        parse_override("lr=3")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config([], ["model.embedding=albert", "train.lr=1e-3"])
    path = cfg.save(tmp_path / "run")
    again = load_config([path])
    assert again == cfg
    assert not list((tmp_path / "run").glob(".*tmp*")), "temp file left behind"


def test_cli_config_command(tmp_path, capsys):
    from megatron_lev.cli import main

    assert main(["config", "model.embedding=tied", "--save", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "embedding: tied" in out and (tmp_path / "config.yaml").exists()
    assert main(["config", "model.nope=1"]) == 2
    assert "unknown config key 'model.nope'" in capsys.readouterr().err


def test_cli_config_file_followed_by_overrides(capsys):
    from megatron_lev.cli import main

    assert (
        main(
            [
                "config",
                "--config",
                str(ROOT / "pretrain/configs/tiny.yaml"),
                "model.embedding=tied",
                "train.lr=5e-4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "embedding: tied" in out and "lr: 0.0005" in out and "name: tiny" in out


def test_a_length_override_a_token_budget_would_outrank_is_refused(tmp_path):
    """The schedule takes chinchilla, then train_tokens, then train_iters: an override of
    train.train_iters on a config with a token budget would be ignored without a word."""
    from megatron_lev.config import ConfigError, load_config

    budget = tmp_path / "budget.yaml"
    budget.write_text("train:\n  train_tokens: 614400\n")
    with pytest.raises(ConfigError, match=r"train.train_iters=20 would be ignored: .*train_tokens=614400"):
        load_config([budget], ["train.train_iters=20"], validate=False)
    cfg = load_config([budget], ["train.train_iters=20", "train.train_tokens=null"], validate=False)
    assert cfg.train.train_iters == 20 and cfg.train.train_tokens is None
    assert load_config([budget], validate=False).train.train_tokens == 614400  # the file alone is fine
    chinchilla = tmp_path / "chinchilla.yaml"
    chinchilla.write_text("train:\n  chinchilla: true\n")
    with pytest.raises(ConfigError, match="add train.chinchilla=false"):
        load_config([chinchilla], ["train.train_iters=20"], validate=False)
