"""The package contract every part of the tool stands on: the manifest type (`core.manifest`),
the errors a user can fix (`core.errors`) and the engines' server commands and versions
(`core.engines`). It imports none of optimizer, exporters, serve, runtime or bench, so a package
made on one machine is read the same way by `serve` or `bench` on another."""
