"""The helpers mpcore's tests share, imported by name (`from helpers import
scaled, run_program`): tests/ is on sys.path under pytest (its conftest.py
puts it there) and in the programs a test starts (TESTS_ON_PATH).

  timescale  how slow the machine is: scaled(), require()
  procfs     what runs and what it holds, read from /proc
  programs   fresh programs and their process trees: run_program, Scenario,
             run_in_session, run_scenario, ScenarioRunner
  memcg      memory cgroups, for shortage tests
  ranks      the one way to start N ranks (NOTE [ Starting N ranks ])
  netns      machines played by network namespaces, for multi-node tests
  layers     what the layer tests share: the cycle search, the length limit

This file re-exports the first four; the few tests that use ranks, netns
or layers import them as modules of their own (`from helpers.ranks import
start_rank`)."""
from .memcg import make_memcg, memory_amounts, remove_memcg, run_in_memcg
from .procfs import (SHM_NAMES, children_of, exited, is_own_zygote, is_resource_tracker,
                     memfd_inodes, mpcore_memfds, mpcore_processes, mpcore_ranges,
                     session_members, shm_gained)
from .programs import (ARTICLE, NO_TORCH_PRELUDE, RUNNER_PIDS, TESTS, TESTS_ON_PATH, Scenario,
                       ScenarioRunner, adopt_orphans, article, fresh_env, module_on_path,
                       module_path, program_result, reap, result, run_in_session, run_program,
                       run_scenario, wait_keeper_gone, wait_session_gone)
from .timescale import IN_CI, TIME_SCALE, TIME_SCALE_VAR, require, scaled
