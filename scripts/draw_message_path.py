"""Draw docs/images/message-path.svg: the path of one message through the broker pair, as a
sequence diagram (docs/architecture.md). Run: python scripts/draw_message_path.py"""

from __future__ import annotations

from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs/images/message-path.svg"
LANES = [
    ("Publisher", "SDK Publisher"),
    ("Broker A", "active"),
    ("Broker B", "standby"),
    ("Subscriber", "SDK Subscriber"),
    ("Monitor", ""),
]
XS = [90, 300, 510, 720, 900]
WIDTH = 1000
STEP = 40


class Diagram:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.y = 118

    def arrow(self, i: int, j: int, number: str, label: str, *, answer: bool = False) -> None:
        x1, x2 = XS[i], XS[j]
        dash = ' stroke-dasharray="6 4"' if answer else ""
        end = x2 - 6 if x2 > x1 else x2 + 6
        self.parts.append(
            f'<line x1="{x1}" y1="{self.y}" x2="{end}" y2="{self.y}" stroke="#333" stroke-width="1.5" '
            f'marker-end="url(#a)"{dash}/>'
        )
        self.parts.append(
            f'<text x="{min(x1, x2) + 8}" y="{self.y - 6}"><tspan font-weight="bold">{number}</tspan> {label}</text>'
        )
        self.y += STEP

    def note(self, lane: int, text: str, fill: str = "#fff7e0") -> None:
        width = 7 * len(text) + 16
        x = min(max(XS[lane], width // 2 + 10), WIDTH - width // 2 - 10)
        self.parts.append(
            f'<rect x="{x - width // 2}" y="{self.y - 22}" width="{width}" height="26" rx="4" fill="{fill}" '
            'stroke="#c9a227"/>'
        )
        self.parts.append(f'<text x="{x}" y="{self.y - 5}" text-anchor="middle" font-size="12">{text}</text>')
        self.y += STEP

    def svg(self) -> str:
        height = self.y + 50
        head = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" font-family="DejaVu Sans, Arial, sans-serif" font-size="13">',
            '<defs><marker id="a" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#333"/></marker></defs>',
            f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
            '<text x="20" y="26" font-size="16" font-weight="bold">The path of one message through the broker pair'
            "</text>",
        ]
        for (name, role), x in zip(LANES, XS, strict=True):
            head.append(f'<rect x="{x - 75}" y="42" width="150" height="42" rx="6" fill="#eef3fb" stroke="#4a6fa5"/>')
            head.append(f'<text x="{x}" y="{60 if role else 68}" text-anchor="middle" font-weight="bold">{name}</text>')
            if role:
                head.append(f'<text x="{x}" y="77" text-anchor="middle" fill="#555">{role}</text>')
            head.append(f'<line x1="{x}" y1="84" x2="{x}" y2="{self.y - 20}" stroke="#999" stroke-dasharray="4 4"/>')
        foot = [
            f'<text x="20" y="{self.y + 4}" fill="#555">Every hop is traced: a send span per batch, the trace '
            "context in each message's headers, process spans linked to it; OTLP to Jaeger</text>",
            f'<text x="20" y="{self.y + 22}" fill="#555">and OTLP/JSON lines to files, which the Spark job turns '
            "into latency, switchover, order and loss reports.</text>",
        ]
        return "\n".join([*head, *self.parts, *foot, "</svg>"]) + "\n"


def main() -> None:
    d = Diagram()
    d.arrow(0, 1, "1", "publish batch: (publisher id, seq), key, headers, body")
    d.arrow(0, 2, "1", "the same batch, on a second stream, in parallel")
    d.note(1, "both hold it in memory, in every matching subscription's queue")
    d.arrow(1, 0, "2", "ack (cumulative)", answer=True)
    d.arrow(2, 0, "2", "ack: published once both hold it (single_copy if one is down)", answer=True)
    d.arrow(3, 1, "3", "credits, and the position it has (one seq per publisher)", answer=True)
    d.arrow(1, 3, "4", "delivery batch, never more than the credits")
    d.note(3, "the SDK drops duplicates and reports gaps: each message once, in per-publisher order")
    d.arrow(1, 2, "5", "delivered watermarks, every few ms")
    d.note(2, "B frees what every subscriber of A has; over its budget it spills the oldest to disk", "#f3eefb")
    d.arrow(4, 1, "6", "stats of both brokers: queue depths, rates, roles", answer=True)
    d.arrow(4, 2, "7", "a slow subscriber: the four switchover steps")
    d.arrow(1, 3, "7", "redirect: continue at B from your own position")
    d.arrow(3, 2, "8", "subscribe at B, which serves it from memory and disk")
    OUT.write_text(d.svg())


if __name__ == "__main__":
    main()
