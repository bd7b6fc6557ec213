"""ortflow's Hydra sweeper: Optuna (current releases) with pruning. Hydra loads sweeper classes only from the
`hydra_plugins` namespace package, so the class lives here; its config is `hydra/sweeper=ortflow_optuna`."""
