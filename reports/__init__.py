"""The reporting layer: what a run leaves for a person. Artifacts that strategies emit
(artifacts.py) and their figures (figures.py), the summary and table (summary.py), the HTML
report (html.py) and the terminal's progress lines (terminal.py). It imports only common/."""
