"""Usage reports for the tenant's and the operators' routes: the period read from the query,
the ledger's totals as a report, and the same report as a CSV download."""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Sequence
from datetime import UTC, datetime, time

from fastapi import Response
from starlette.concurrency import run_in_threadpool

from api.schemas import UsageItem, UsageReport
from cloud.errors import InvalidRequest
from cloud.metering import Ledger

# the OpenAPI entry of a route that also answers text/csv
CSV_RESPONSES: dict = {200: {"content": {"text/csv": {}}, "description": "the report, or its CSV"}}
FROM_HELP = "start of the period, inclusive: an ISO-8601 date or date and time (UTC unless it names an offset)"
TO_HELP = "end of the period, exclusive: an ISO-8601 date or date and time (UTC unless it names an offset)"
FORMAT_HELP = "csv for a CSV download (or send Accept: text/csv); json by default"

_TOTALS = ("requests", "rows", "billed_seconds", "cost", "prompt_tokens", "completion_tokens")


def parse_instant(parameter: str, value: str | None) -> datetime | None:
    """An ISO-8601 date (its midnight) or date and time, in UTC; None when not given."""
    if value is None or not value.strip():
        return None
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        # a '+' of an offset sent unencoded in a URL arrives as a space
        hint = "; send a '+' in a URL as %2B" if " " in value.strip() else ""
        raise InvalidRequest(
            f"{parameter}: {value!r} is not an ISO-8601 date or date and time "
            f"(such as 2026-01-31 or 2026-01-31T12:00:00Z){hint}",
            parameter=parameter,
        ) from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def parse_period(start: str | None, end: str | None) -> tuple[datetime | None, datetime | None]:
    """`from` and `to` of a usage query; `to` is exclusive and may not precede `from`."""
    first, last = parse_instant("from", start), parse_instant("to", end)
    if first is not None and last is not None and first > last:
        raise InvalidRequest(
            f"from ({first.isoformat()}) is after to ({last.isoformat()})", parameter="from"
        )
    return first, last


def wants_csv(format: str | None, accept: str | None) -> bool:
    """`?format=` decides; without it, an Accept header naming text/csv does."""
    if format is not None:
        return format == "csv"
    media_types = {part.split(";")[0].strip().lower() for part in (accept or "").split(",")}
    return "text/csv" in media_types


async def build_report(
    ledger: Ledger,
    dimensions: Sequence[str],
    group_by: str,
    tenant: str | None,
    tenant_id: int | None,
    period: tuple[datetime | None, datetime | None],
) -> UsageReport:
    start, end = period
    rows = await run_in_threadpool(ledger.totals, dimensions, tenant_id=tenant_id, start=start, end=end)
    items = [UsageItem(**row) for row in rows]
    return UsageReport(
        tenant=tenant,
        group_by=group_by,
        start=start,
        end=end,
        items=items,
        total_billed_seconds=sum(i.billed_seconds for i in items),
        total_cost=sum(i.cost for i in items),
    )


def csv_response(report: UsageReport, dimensions: Sequence[str]) -> Response:
    """The report's items as CSV: a header row, then a row per group, as a download."""
    keys = [f for d in dimensions for f in (("version", "target", "price_per_second") if d == "version" else (d,))]
    columns = [*keys, *_TOTALS]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for item in report.items:
        values = item.model_dump()
        writer.writerow(["" if values[c] is None else values[c] for c in columns])
    name = "-".join(
        ["luminal-usage", _safe(report.tenant or "all-tenants"), report.group_by, _stamp(report.start, "start"),
         _stamp(report.end, "now")]
    )
    headers = {"Content-Disposition": f'attachment; filename="{name}.csv"'}
    return Response(out.getvalue(), media_type="text/csv; charset=utf-8", headers=headers)


def _stamp(instant: datetime | None, unbounded: str) -> str:
    if instant is None:
        return unbounded
    return instant.date().isoformat() if instant.time() == time(0) else instant.strftime("%Y-%m-%dT%H%M%SZ")


def _safe(name: str) -> str:
    # a filename in a quoted header: no quotes, slashes or control characters
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)
