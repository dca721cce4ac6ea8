"""What both HTTP surfaces share (the server extension's and the broker's REST APIs).

:mod:`.jsonapi` (JSON bodies, errors as one-line JSON answers), :mod:`.views` (the JSON views of a
kernel's slice) and :mod:`.metrics` (the Prometheus exposition of the pool).
"""
