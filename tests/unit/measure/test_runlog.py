"""memlab's console and log (:mod:`memlab.measure.runlog`), as memlab's Hydra job logging sets
them up: other libraries' warnings go to the log, counted on the console in one line; memlab's
own warnings and any library's errors stay on the console; a library that adds its own console
handler mid-run (DeepSpeed, on import) is caught too; transformers' bars are off in a run. And a
sweep job's log (:class:`hydra_plugins.memlab_launcher.joblog.Lines`) keeps the last state of
each progress line."""

from __future__ import annotations

import logging
import logging.config
import sys
import warnings

import pytest
from omegaconf import OmegaConf

from hydra_plugins.memlab_launcher.joblog import Lines, console_only
from memlab.cli.compose import conf_dir
from memlab.measure import runlog
from memlab_testing import root_logger_kept


@pytest.fixture
def job_logging(tmp_path):
    """The root logger as Hydra configures it from conf/hydra/job_logging/memlab.yaml (the log
    in ``tmp_path``); put back as it was afterwards."""
    spec = OmegaConf.load(conf_dir() / "hydra" / "job_logging" / "memlab.yaml")
    spec.handlers.file.filename = str(tmp_path / "memlab.log")
    with root_logger_kept():
        logging.config.dictConfig(OmegaConf.to_container(spec))
        yield tmp_path / "memlab.log"


def _library_warning(message: str) -> None:
    """A FutureWarning raised from another library's file."""
    warnings.warn_explicit(message, FutureWarning, "/site-packages/somelib/module.py", 7,
                           module="somelib.module")


@pytest.fixture(params=["as shipped", "propagating", "two console handlers"])
def transformers_logger(request):
    """transformers' logger as it ships (its own console handler, not propagating), and as a
    user's code may leave it: propagating to the root (``enable_propagation()``), or with a
    second console handler. Each warning is logged and counted once in all three."""
    from transformers.utils import logging as hf_logging

    logger = hf_logging.get_logger("transformers")
    saved = logger.propagate, logger.handlers[:]
    if request.param == "propagating":
        logger.propagate = True
    elif request.param == "two console handlers":
        logger.addHandler(logging.StreamHandler(sys.stderr))
    yield
    logger.propagate, logger.handlers[:] = saved


def test_other_libraries_warnings_go_to_the_log_counted_in_one_console_line(
        job_logging, transformers_logger, capsys):
    from transformers.utils import logging as hf_logging

    with runlog.quiet_libraries():
        assert not hf_logging.is_progress_bar_enabled()  # "Writing model shards" and co.
        _library_warning("`foo` is deprecated")
        logging.getLogger("transformers.modeling_utils").warning("transformers speaking")
        deepspeed = logging.getLogger("DeepSpeed")  # as DeepSpeed sets it up on import
        own = logging.StreamHandler(sys.stdout)
        deepspeed.addHandler(own)
        deepspeed.propagate = False
        try:
            deepspeed.warning("Setting accelerator to CPU")
        finally:
            deepspeed.removeHandler(own)
        logging.getLogger("datasets").error("a library's error")
        runlog.warn("memlab's own warning")
        runlog.file_only("step 1/2: train/loss 1.0")
        runlog.say("memlab's own line")
    assert hf_logging.is_progress_bar_enabled()  # as it was
    out, err = capsys.readouterr()
    console = out + err
    for quiet in ("deprecated", "transformers speaking", "Setting accelerator", "step 1/2"):
        assert quiet not in console, console
    assert "[memlab] warning: memlab's own warning" in err and "a library's error" in err
    assert "memlab's own line" in out
    assert out.strip().endswith(f"3 warnings from other libraries: see {job_logging}")
    log = job_logging.read_text()
    for line in ("FutureWarning: `foo` is deprecated",
                 "[transformers.modeling_utils] WARNING: transformers speaking",
                 "[DeepSpeed] WARNING: Setting accelerator to CPU",
                 "[datasets] ERROR: a library's error", "memlab's own warning",
                 "step 1/2: train/loss 1.0", "memlab's own line", "3 warnings from other"):
        assert line in log, line
    assert log.count("Setting accelerator") == 1 and log.count("transformers speaking") == 1


def test_outside_a_run_or_without_a_log_file_nothing_is_hidden(job_logging, capsys):
    logging.getLogger("transformers.x").propagate = True  # (a library logging to the root)
    logging.getLogger("somelib").warning("outside a run")
    root = logging.getLogger()
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    for h in files:
        root.removeHandler(h)
    with runlog.quiet_libraries():
        logging.getLogger("somelib").warning("no log to put it in")
    out, err = capsys.readouterr()
    assert "outside a run" in err and "no log to put it in" in err
    assert "warnings from other libraries" not in out + err


def test_a_sweep_job_logs_to_its_file_only_what_its_console_leaves_out(job_logging):
    spec = OmegaConf.create({"hydra": {"job_logging": OmegaConf.load(
        conf_dir() / "hydra" / "job_logging" / "memlab.yaml")}})
    console_only(spec)
    handler = spec.hydra.job_logging.handlers.file
    assert handler.mode == "a" and list(handler.filters) == ["not_on_console"]
    keep = runlog.NotOnConsole()
    record = logging.LogRecord("memlab", logging.INFO, __file__, 1, "said", None, None)
    assert not keep.filter(record)  # the launcher copies it from the console
    record.console = False
    assert keep.filter(record)  # the file's own line


def test_a_job_log_keeps_the_last_state_of_each_progress_line():
    lines = Lines()
    chunks = [b"\rtok:   0%|", b"   | 0/4\rtok:  50%|##  | 2/4\rto", b"k: 100%|####| 4/4  \n",
              b"said\n\rtrain: 1/3", b"\rtrain: 2/3\r", b"\n", b"a\r\nlast\rtrain: 3/3"]
    got = b"".join(lines.feed(c) for c in chunks) + lines.end()
    assert got == b"tok: 100%|####| 4/4\nsaid\ntrain: 2/3\na\ntrain: 3/3\n"
    assert lines.end() == b""
