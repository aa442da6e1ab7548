package statuspage

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// chart is the geometry of the throughput chart, drawn by the template as
// inline SVG: one polyline per series, one point per minute.
type chart struct {
	Width, Height   float64
	Left, Right     float64
	Top, Bottom     float64
	Series          []chartSeries
	YTicks          []chartTick
	XTicks          []chartTick
	HasData, Exists bool
}

type chartSeries struct {
	Name   string // received, processed, failed, dead
	Label  string
	Points []chartPoint
	Line   string // the polyline's points attribute
}

type chartPoint struct {
	X, Y   float64
	Minute time.Time
	Value  int64
}

type chartTick struct {
	Pos    float64
	Label  string
	Anchor string // text-anchor of the label
}

// newChart lays out minutes (oldest first) in a width×height box.
func newChart(minutes []Minute) chart {
	c := chart{Width: 720, Height: 220, Left: 44, Right: 12, Top: 12, Bottom: 28, Exists: len(minutes) > 0}
	series := []struct {
		name, label string
		value       func(Minute) int64
	}{
		{"received", "received", func(m Minute) int64 { return m.Received }},
		{"processed", "processed", func(m Minute) int64 { return m.Processed }},
		{"failed", "failed attempts", func(m Minute) int64 { return m.Failed }},
		{"dead", "dead", func(m Minute) int64 { return m.Dead }},
	}
	var top int64
	for _, m := range minutes {
		for _, s := range series {
			top = max(top, s.value(m))
		}
	}
	c.HasData = top > 0
	top = niceCeil(top)
	plotW := c.Width - c.Left - c.Right
	plotH := c.Height - c.Top - c.Bottom
	x := func(i int) float64 {
		if len(minutes) < 2 {
			return c.Left + plotW/2
		}
		return c.Left + plotW*float64(i)/float64(len(minutes)-1)
	}
	y := func(v int64) float64 { return c.Top + plotH*(1-float64(v)/float64(top)) }
	for _, s := range series {
		cs := chartSeries{Name: s.name, Label: s.label}
		var line []string
		for i, m := range minutes {
			p := chartPoint{X: round1(x(i)), Y: round1(y(s.value(m))), Minute: m.Minute, Value: s.value(m)}
			cs.Points = append(cs.Points, p)
			line = append(line, fmt.Sprintf("%g,%g", p.X, p.Y))
		}
		cs.Line = strings.Join(line, " ")
		c.Series = append(c.Series, cs)
	}
	for _, v := range []int64{0, top / 2, top} {
		c.YTicks = append(c.YTicks, chartTick{Pos: round1(y(v)), Label: strconv.FormatInt(v, 10), Anchor: "end"})
	}
	for i, m := range minutes {
		anchor := "middle"
		switch {
		case i == 0:
			anchor = "start"
		case i == len(minutes)-1:
			anchor = "end"
		case i%5 != 0 || len(minutes)-1-i < 3:
			continue // no label, or too close to the last one
		}
		c.XTicks = append(c.XTicks, chartTick{Pos: round1(x(i)), Label: m.Minute.UTC().Format("15:04"), Anchor: anchor})
	}
	return c
}

// niceCeil returns the chart's top for a largest value n: twice the
// smallest of 1, 2 or 5 times a power of ten that covers half of n, so the
// middle tick is a round number too.
func niceCeil(n int64) int64 {
	half := max((n+1)/2, 1)
	for p := int64(1); ; p *= 10 {
		for _, f := range []int64{1, 2, 5} {
			if f*p >= half {
				return 2 * f * p
			}
		}
	}
}

func round1(f float64) float64 {
	return float64(int64(f*10+0.5)) / 10
}
