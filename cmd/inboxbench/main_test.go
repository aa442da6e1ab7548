package main

import (
	"testing"

	"github.com/orderconfirm/inboxd/internal/testenv"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }
