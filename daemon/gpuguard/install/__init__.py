"""Installing gpuguard as a systemd service on a host (`gpuguard install-service`,
`gpuguard uninstall-service`). The unit and the annotated example config ship inside the
package (links to units/gpuguard.service and config/gpuguard.yaml in the source tree), so
a pipx or venv install can write them without a clone."""
