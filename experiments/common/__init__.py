"""The Hydra plumbing every command of the harness shares; it imports no experiment.

* :mod:`experiments.common.launch`: :func:`~experiments.common.launch.launch` runs a Hydra app as
  a command: composition errors as one line naming the bad value (exit 2), launch checks Hydra
  would silently get wrong (:func:`~experiments.common.launch.launch_problem`), Ctrl-C and
  SIGTERM as one line (exit 130 / 143) with every child process ended.
* :mod:`experiments.common.callbacks`: the Hydra callbacks: one lock per experiment folder, a
  record per job under every launcher, an exit code that says whether every job succeeded
  (:class:`~experiments.common.callbacks.ExperimentFolder`), and for ``flashcp-run`` the merge of
  the jobs' rows and the figures (:class:`~experiments.common.callbacks.AggregateResults`).
* :mod:`experiments.common.entry`: what an experiment with its own command shares: the fields
  where it writes (:class:`~experiments.common.entry.ExperimentConfig`), its folder name
  ``${experiment_key:}``, registering its schema, the common checks and the body of its app
  (:func:`~experiments.common.entry.run_experiment`); which experiments have a command is read
  from ``conf/*.yaml`` (:func:`~experiments.common.entry.experiment_commands`).
* :mod:`experiments.common.overrides`: what a job's command line set (explicit hardware
  constants win over the fitted ones in every command).
* :mod:`experiments.common.grid` and :mod:`experiments.common.rows`: ``flashcp-run``'s parts
  that are no Hydra app: the runs of a job's ``grid`` and the checks before any work; each run's
  identity, the columns its rows share and a failed job's error rows.

The rooms of ``experiments/``: this package (plumbing); one module per experiment, each a Hydra
app with its schema beside it (``run.py``: ``flashcp-run``, the sweeps of ``conf/experiment/``;
``table2.py``, ``calibration.py``, ``sensitivity.py``, ``fig3.py``: one command each); the tools
they share (``aggregate.py``: merging and summaries; ``plot.py``: figures); ``benchmarks/``
(argparse scripts, not Hydra apps); ``gpu_check.py`` (the GPU machine's check, without Hydra).
Imports go one way: experiments import this package and the library, this package imports the
library and the shared tools (the merge callback calls ``aggregate`` and ``plot``), never an
experiment; ``tests/house/test_import_graph.py`` fails on any circle.

Adding an experiment with its own command ``flashcp-<name>``:

1. ``conf/<name>.yaml``, whose first comment is the command that runs it::

       # flashcp-<name> (or python -m experiments.<name>): what it computes ...
       defaults:
         - base_<name>                 # its schema, registered by its module
         - override hydra/help: experiment
         - _self_
       run_key: ${experiment_key:}
       hydra:
         run: {dir: "${results_dir}/${name}/runs/${run_key}"}
         sweep: {dir: "${results_dir}/${name}", subdir: "runs/${run_key}"}
         job: {chdir: false}
         callbacks:
           folder:
             _target_: experiments.common.callbacks.ExperimentFolder
             prog: flashcp-<name>      # the command; flashcp-run experiment=<name> names it

2. ``experiments/<name>.py``: its schema (a dataclass extending
   :class:`~experiments.common.entry.ExperimentConfig`; every field says its unit and values), the
   work (``cfg -> path of the main table``), and the app::

       PROG = "flashcp-<name>"

       @dataclass
       class NameConfig(ExperimentConfig):
           name: str = "<name>"
           cp_size: int = 8           #: N, number of CP ranks

       def work(cfg) -> Path: ...    # writes <results_dir>/<name>/, returns its main file

       register_experiment("<name>", NameConfig)

       @hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="<name>")
       def main(cfg):
           return run_experiment(cfg, work)   # + check=... for fields of its own

       def cli(argv=None):
           launch(main, PROG, argv)

       if __name__ == "__main__":
           cli()

3. its console script in ``pyproject.toml``: ``flashcp-<name> = "experiments.<name>:cli"``
   (the script exists once the project is installed again, ``pip install -e .``;
   ``python -m experiments.<name>`` runs at once).

Nothing else changes: ``flashcp-run experiment=<name>`` names the new command, its ``--help``
lists its fields, and the tests of every experiment's config and command pick it up from
``conf/<name>.yaml``. A sweep of ``flashcp-run`` is only a file ``conf/experiment/<name>.yaml``.
"""
