package pgsession_test

import (
	"testing"

	"github.com/orderconfirm/inboxd/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }
