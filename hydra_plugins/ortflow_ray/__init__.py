"""ortflow's Hydra launcher for Ray clusters (`hydra/launcher=ray`). Hydra loads launcher classes only from the
`hydra_plugins` namespace package, so the class lives here."""
