"""Incident reports: a window of the flight recorder drawn on one time axis — every GPU's
power, temperatures, clocks and fan, engine progress, and the kernel lines and gpuguard
events — as one self-contained HTML file (inline SVG) and a PNG, with no network and no
plotting library (the hosts in INCIDENTS.md are often air-gapped workstations).

Modules: history (the flight recorder read back: series and events in a window; the
page and `gpuguard record` read it too), figure (what is plotted: panels, series,
scales, markers), svg, png (+ font), html (the page around the figures), incident and
make (a report of an engine incident bundle / of a recorder window).
"""
