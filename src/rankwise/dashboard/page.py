"""The dashboard's one HTML page, a Jinja template (Flask escapes every value put in it; only
the SVG pictures, which ``plots`` draws, go in unescaped).

No script: the page reloads itself (``<meta http-equiv="refresh">``) while the job runs.
"""

from __future__ import annotations

TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
{% if refresh %}<meta http-equiv="refresh" content="{{ refresh }}">{% endif %}
<title>rankwise: {{ s.run_dir }}</title>
<style>
body { font-family: sans-serif; margin: 1.2em; color: #222; max-width: 1100px; }
h1 { font-size: 1.3em; margin-bottom: 0.2em; }
h2 { font-size: 1.05em; margin: 0.4em 0; }
.facts { color: #555; margin-bottom: 0.8em; }
.banner { padding: 0.5em 0.8em; border-radius: 4px; margin: 0.5em 0; }
.straggler { background: #fff3cd; border: 1px solid #e0b000; }
.healthy { background: #e6f4ea; border: 1px solid #5a9e6f; }
.hang { background: #fde8e8; border: 1px solid #c0392b; }
.hang pre { white-space: pre-wrap; margin: 0.3em 0 0 0; }
section { border: 1px solid #ddd; border-radius: 4px; padding: 0.5em 0.8em; margin: 0.8em 0; }
section svg { max-width: 100%; height: auto; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { padding: 0.15em 0.6em; text-align: right; border-bottom: 1px solid #eee; }
td.text, th.text { text-align: left; }
pre { font-size: 0.85em; overflow-x: auto; }
</style>
</head>
<body>
<h1>rankwise: {{ s.run_dir }}</h1>
{% if s.step is none %}
<p class="facts" id="facts">Waiting for the first step record ({{ steps_file }}).</p>
{% else %}
<p class="facts" id="facts">step {{ s.step }} &middot; {{ s.strategy }} &middot; {{ s.world }} ranks
{% if s.steps_per_s is not none %}&middot; {{ "%.2f"|format(s.steps_per_s) }} steps/s{% endif %}
{% if s.step_s is not none %}&middot; {{ "%.1f"|format(s.step_s * 1000) }} ms/step{% endif %}
{% if s.age_s is not none %}&middot; last record {{ age }} ago{% endif %}
{% if s.skipped %}&middot; {{ s.skipped }} malformed line(s) skipped{% endif %}</p>
{% endif %}
{% if s.hang %}
<div class="banner hang" id="hang"><h2>Hang</h2><pre>{{ s.hang.text }}</pre></div>
{% endif %}
<div class="banner {{ 'straggler' if s.straggler else 'healthy' }}" id="straggler">
<h2>Straggler</h2>{{ straggler_line }}</div>
<section id="anatomy"><h2>Step anatomy per rank</h2>{{ bars|safe }}</section>
<section id="anatomy-over-time"><h2>Step anatomy over time</h2>
{% if shown|length < s.ranks|length %}<p>Showing ranks {{ shown|join(", ") }} of {{ s.ranks|length }}:
the straggler and the ranks that work longest.</p>{% endif %}
{{ over_time|safe }}</section>
<section id="memory"><h2>Memory per rank</h2>{{ memory|safe }}</section>
<section id="throughput"><h2>Throughput</h2>{{ throughput|safe }}</section>
<section id="events"><h2>Events</h2>
{% if s.events %}<table><tr><th>step</th><th class="text">event</th><th class="text">what</th></tr>
{% for e in s.events|reverse %}<tr><td>{{ e.step if e.step is not none else "" }}</td>
<td class="text">{{ e.event }}</td><td class="text">{{ e.text }}</td></tr>
{% endfor %}</table>{% else %}<p>No straggler or hang so far.</p>{% endif %}
</section>
{% if end_summary %}<section id="end-of-run"><h2>End of run</h2><pre>{{ end_summary }}</pre>
</section>{% endif %}
</body>
</html>
"""

WAITING = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
{% if refresh %}<meta http-equiv="refresh" content="{{ refresh }}">{% endif %}
<title>rankwise: starting</title></head>
<body style="font-family: sans-serif"><h1>rankwise</h1>
<p id="facts">Waiting for the job to start: its run directory is not named yet (or step timing
is off: --profile-steps 0).</p></body></html>
"""
